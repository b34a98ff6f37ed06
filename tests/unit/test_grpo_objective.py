"""GRPO's objective (trainer/grpo.py) through the real trainer on a 1-rank gloo group in this process: the trained
log-probs are the sampler's at the completion tokens (the mask sits on the completions), advantages are the rewards'
group-relative values, num_iterations > 1 keeps the sampling policy's log-probs (ratio 1 on the round's first step:
the same loss as one pass) and reuses the round's completions; the global order of a step's figures over ranks; the
schema's grpo checks. 2 ranks = 1 rank: tests/distributed/test_grpo.py; the CLI: tests/integration/test_grpo_train.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardtune.config.load import load_recipe
from shardtune.trainer import grpo
from shardtune.trainer.grpo_loss import group_advantages
from shardtune.trainer.sampling import sample_completions
from shardtune.trainer.train import setup, train_step

REPO = Path(__file__).resolve().parents[2]
# a dense reward from a file (random init never reverses a string: exact match alone gives only ties)
REWARDS = f"grpo.reward_funcs=[exact_match,{REPO}/tests/unit/grpo_letters.py:letters]"


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    from shardtune.trainer.runtime import free_port

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield tmp_path_factory.mktemp("grpo")
    dist.destroy_process_group()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _run(tmp: Path, name: str, *extra: str):
    recipe = load_recipe(REPO / "recipes" / "tiny-grpo-cpu.yaml", [
        "model.path=null", "model.init=random", f"model.config={REPO}/configs/models/tiny-llama.json",
        "data.num_samples=200", f"data.cache_dir={tmp}/cache", f"train.output_dir={tmp}/{name}",
        "train.micro_batch_size=2", "train.grad_accum=2", "grpo.num_generations=4", "train.lr=1e-2",
        "train.eval_batches=1", REWARDS, *extra])
    return setup(recipe)


def test_logps_mask_and_advantages_match_the_sampler_and_rewards(one_rank):
    run = _run(one_rank, "pieces")
    obj = run.objective
    obj.before_step(run.model, run.rt, run.run_dir, 0, global_size=run.batches.global_size)
    micro, _ = run.batches.step(0, 0)
    rows = [r for mb in micro for r in obj.train_rows.take(mb.prompt_ids)]
    completions, logprobs = sample_completions(
        run.model, [r.ids for r in rows], keys=[(0, 0, int(i)) for mb in micro for i in mb.prompt_ids],
        num_generations=4, max_new_tokens=8, temperature=obj.cfg.temperature, stop_ids=[2], pad_id=0, prompts_per_batch=2, device="cpu",
        logprobs=True)
    total, _ = obj._score(rows, completions, 4, 0)
    want_adv = group_advantages(torch.tensor(total, dtype=torch.float64), 4, scale_rewards="group").float()
    assert torch.tensor(total).std() > 0  # the test means something: the groups are not all ties
    got_adv = torch.cat([r.advantages for r in obj.rollouts])
    assert torch.equal(got_adv, want_adv)
    with torch.no_grad():
        for a, r in enumerate(obj.rollouts):
            lp = obj._token_logps(run.model, r.input_ids)
            for i in range(r.input_ids.shape[0]):
                c = a * 8 + i
                on = r.mask[i].bool()
                assert int(on.sum()) == len(completions[c])  # the mask covers the completion, EOS included
                assert r.input_ids[i, 1:][on].tolist() == completions[c]
                assert torch.allclose(lp[i][on], torch.tensor(logprobs[c]), atol=1e-5)
    assert obj.norms == (16, sum(len(c) for c in completions))  # global counts: 1 rank, 2 x 2 prompts x 4


def test_num_iterations_keeps_old_logps_and_reuses_the_round(one_rank):
    one = [train_step(_run(one_rank, "iter1"), 0, None)]
    run = _run(one_rank, "iter2", "grpo.num_iterations=2", "grpo.epsilon=0.01")
    two = [train_step(run, s, None) for s in range(3)]
    assert one[0]["loss"] != 0 and abs(two[0]["loss"] - one[0]["loss"]) <= 1e-6  # ratio 1: the same loss
    assert two[0]["clip_ratio/region_mean"] == 0
    same = ("reward", f"rewards/{REPO}/tests/unit/grpo_letters.py:letters/mean", "completions/mean_length", "frac_reward_zero_std")
    assert all(two[1][k] == two[0][k] for k in same)  # step 2 trains on step 1's completions
    assert two[1]["clip_ratio/region_mean"] > 0  # the policy moved: its ratio is clipped (epsilon 0.01)
    assert any(two[2][k] != two[1][k] for k in same)  # step 3 samples a new round
    keys = {"reward", "reward_std", "rewards/exact_match/mean", "rewards/exact_match/std", "frac_reward_zero_std",
            "completions/mean_length", "completions/max_length", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "gen_tokens_per_s", "prompts"}
    assert keys <= two[0].keys() and "kl" not in two[0]  # beta 0: no KL
    assert "start_eval_reward" in two[0] and "start_eval_reward" not in two[1]


def test_the_steps_figures_are_gathered_in_global_order(monkeypatch):
    """Rank r's micro-step a holds global completions [(a*W + r)*m, +m): all-gathered rows come back in that order,
    and _local_slice picks a rank's own."""
    world, accum, m = 2, 2, 3
    glob = torch.arange(world * accum * m, dtype=torch.float64)
    mine = [grpo._local_slice(r, world=world, accum=accum, per_micro=m) for r in range(world)]
    assert mine[1].tolist() == [3, 4, 5, 9, 10, 11]
    parts = [glob[s].view(1, -1) for s in mine]

    def all_gather(out, local, group=None):
        for o, p in zip(out, parts):
            o.copy_(p)

    monkeypatch.setattr(grpo.dist, "all_gather", all_gather)
    monkeypatch.setattr(grpo.accelerator, "host_group", lambda: None)
    monkeypatch.setattr(grpo.dist, "get_world_size", lambda group=None: world)  # every rank in the host group
    assert torch.equal(grpo._gather_global(parts[0], world=world, accum=accum)[0], glob)


@pytest.mark.parametrize("override,message", [
    ("grpo.num_generations=1", "grpo.num_generations: must be >= 2"),
    ("grpo.loss_type=ppo", "grpo.loss_type: must be one of grpo, dr_grpo, dapo, bnpo, got 'ppo'"),
    ("grpo.scale_rewards=std", "grpo.scale_rewards: must be one of group, batch, none, got 'std'"),
    ("grpo.reward_weights=[1,2]", "grpo.reward_weights: must be 1 numbers"),
    ("data.format=instruction", "train.objective: objective grpo with data.format=instruction"),
])
def test_schema_refuses_bad_grpo_settings_in_one_line(override, message):
    with pytest.raises(ValueError) as e:
        load_recipe(REPO / "recipes" / "tiny-grpo-cpu.yaml", [override])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    for lora in ("true", "false"):  # the reference: the base with adapters off, or a frozen copy (full fine-tuning)
        assert load_recipe(REPO / "recipes" / "tiny-grpo-cpu.yaml", ["grpo.beta=0.04", f"lora.enabled={lora}"]
                           ).grpo.beta == 0.04


def test_sft_with_prompt_data_is_one_line_exit_2_in_validate(capsys):
    from tests.unit.cli_helpers import run_cli

    code, _, err = run_cli(["validate", "tiny-grpo-cpu", "train.objective=sft"], capsys)
    assert code == 2 and err.count("\n") == 1 and "data.format: objective sft with data.format=prompt" in err, err


def test_validate_takes_a_kl_term_under_full_finetuning(capsys):
    """The reference is a frozen sharded copy there (it was refused: 'full fine-tuning has no frozen copy yet')."""
    from tests.unit.cli_helpers import run_cli

    code, out, err = run_cli(["validate", "tiny-grpo-cpu", "grpo.beta=0.04"], capsys)
    assert code == 0 and "grpo.beta" not in err, (out, err)


def test_a_step_makes_positive_advantage_completions_likelier(one_rank):
    """The loss's sign: after one small step, sum_i A_i (log p_new - log p_old) over the step's completions is > 0."""
    run = _run(one_rank, "sign", "train.lr=1e-4", "train.grad_accum=1")
    obj = run.objective
    before = None

    def logps():
        with torch.no_grad():
            return [(obj._token_logps(run.model, r.input_ids) * r.mask).sum(-1) for r in obj.rollouts]

    orig = obj.before_step

    def hooked(*a, **k):
        nonlocal before
        out = orig(*a, **k)
        before = logps()
        return out

    obj.before_step = hooked
    train_step(run, 0, None)
    gain = sum(float((r.advantages * (new - old)).sum()) for r, new, old in zip(obj.rollouts, logps(), before))
    assert gain > 0, gain


def test_progress_line_shows_the_grpo_figures():
    from shardtune.trainer.progress import reward_parts

    record = {"reward": 0.25, "reward_std": 0.4, "frac_reward_zero_std": 0.5, "completions/mean_length": 5.25,
              "rewards/exact_match/mean": 0.25, "rewards/exact_match/std": 0.4, "rewards/a/b/f.py:fn/mean": 0.125,
              "clip_ratio/region_mean": 0.01, "gen_tokens_per_s": 1234.0, "kl": 0.0012, "eval_reward": 0.5}
    assert reward_parts(record) == ["reward 0.250±0.400", "zero_std 0.50", "len 5.2", "exact_match 0.250",
                                    "f.py:fn 0.125", "kl 0.0012", "clip 0.010", "gen 1,234 tok/s",
                                    "eval_reward 0.500"]
    assert reward_parts({"loss": 1.0}) == []


def test_a_grpo_eval_step_prints_its_line():
    """GRPO's evals have no eval_loss: eval_reward makes the step's plain line due, as eval_loss does."""
    import io

    from shardtune.trainer.progress import PlainProgress

    out = io.StringIO()
    p = PlainProgress(max_steps=100, start_step=0, log_every=20, out=out)
    base = {"loss": 0.0, "lr": 1e-3, "tokens": 10, "step_time_s": 1.0, "epoch": 0.1}
    for step in (1, 2, 3):
        p.update({**base, "step": step, **({"eval_reward": 0.5} if step == 3 else {})})
    assert [ln.split()[1] for ln in out.getvalue().splitlines()] == ["1/100", "3/100"]
    assert "eval_reward 0.500" in out.getvalue().splitlines()[1]


def test_lora_reference_is_the_base_with_adapters_off(one_rank):
    """grpo.beta > 0 under LoRA: the reference log-probs are the base's (adapters off). At step 1 the adapters are
    zero (policy = reference): KL 0; after a step the policy moved from the base: KL > 0."""
    run = _run(one_rank, "lora", "lora.enabled=true", "lora.r=4", "grpo.beta=0.04", "train.lr=5e-2")
    records = [train_step(run, s, None) for s in range(2)]
    assert abs(records[0]["kl"]) < 1e-7 and records[1]["kl"] > 1e-6, [r["kl"] for r in records]
    r = run.objective.rollouts[0]
    assert r.ref_logps is not None and r.old_logps is None  # one pass per round: no kept log-probs


def test_full_finetuning_reference_is_the_starting_weights_after_a_resume(one_rank):
    """grpo.beta > 0, full fine-tuning: the reference is a frozen copy of the starting weights (trainer/reference.py),
    KL 0 at step 1 (policy = reference), > 0 after. A run resumed at step 2 rebuilds it from the model source (the
    seeded random init), not from the checkpoint: the same reference, so its step 3 is the uninterrupted run's."""
    from shardtune.trainer.train import resume, save_checkpoint

    extra = ("grpo.beta=0.5", "train.grad_accum=1")
    run = _run(one_rank, "full_kl", *extra)
    records = [train_step(run, s, None) for s in range(2)]
    save_checkpoint(run, 2)
    records.append(train_step(run, 2, None))
    assert records[0]["kl"] == 0 and records[1]["kl"] > 1e-6, [r["kl"] for r in records]
    ref = run.objective.reference
    assert ref is not None and all(not p.requires_grad and p.grad is None for p in ref.module.parameters())
    trained = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert trained.isdisjoint(id(p) for p in ref.module.parameters())
    resumed = _run(one_rank, "full_kl", *extra)
    assert resume(resumed) == 2
    again = train_step(resumed, 2, None)
    for a, b in zip(ref.module.parameters(), resumed.objective.reference.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert again["kl"] == records[2]["kl"] > 1e-6 and again["loss"] == records[2]["loss"]


def test_round_metrics_are_trls_figures_over_the_global_batch():
    from shardtune.trainer.runtime import Runtime

    # 2 groups of 2: totals [1, 0 | 0.5, 0.5]; one function; clipped [0, 1, 0, 0]; lengths [3, 8, 4, 5]
    glob = torch.tensor([[1, 0, .5, .5], [1, 0, .5, .5], [0, 1, 0, 0], [3, 8, 4, 5]], dtype=torch.float64)
    m = grpo._round_metrics(glob, ["f"], 2, 2.0, Runtime(0, 1, 0, torch.device("cpu")))
    want_std = torch.tensor([1, 0, .5, .5], dtype=torch.float64).std().item()
    assert m == {"reward": 0.5, "reward_std": want_std, "rewards/f/mean": 0.5, "rewards/f/std": want_std,
                 "frac_reward_zero_std": 0.5, "completions/mean_length": 5.0, "completions/min_length": 3.0,
                 "completions/max_length": 8.0, "completions/clipped_ratio": 0.25, "gen_tokens_per_s": 10.0}
