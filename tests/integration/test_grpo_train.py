"""`shardtune train tiny-grpo-cpu` through the installed executable on 2 CPU workers, at small settings (random init,
3 steps, 2 prompts x 4 completions per rank, a dense reward from a file so the loss is not zero): GRPO's keys reach
metrics.jsonl, the progress line and the summary line print, and final/ loads back as an HF model. Then learning, as
shipped with a format reward: the held-out line rises from 0% to 100% in 10 steps. The recipe's reversal task (exact
match, after an SFT warm-up) learns too slowly for the suite: its measured run is in its header."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.integration.runs import cli, metrics

REPO = Path(__file__).resolve().parents[2]

KEYS = {"loss", "grad_norm", "prompts", "reward", "reward_std", "rewards/exact_match/mean", "rewards/exact_match/std",
        "frac_reward_zero_std", "completions/mean_length", "completions/min_length", "completions/max_length",
        "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "gen_tokens_per_s"}


def test_tiny_grpo_cpu_trains_through_the_cli(tmp_path):
    letters = f"{REPO}/tests/unit/grpo_letters.py:letters"
    run = tmp_path / "run"
    proc = cli("train", "tiny-grpo-cpu", f"train.output_dir={run}", "data.num_samples=200", "train.max_steps=3",
               "train.micro_batch_size=2", "grpo.num_generations=4", "train.eval_batches=1", "train.log_every=1",
               f"grpo.reward_funcs=[exact_match,{letters}]", "grpo.reward_weights=[1.0,0.5]", "train.lr=1e-2",
               cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert KEYS | {f"rewards/{letters}/mean"} <= r.keys(), sorted(r)
        assert r["prompts"] == 4 and 1 <= r["completions/mean_length"] <= 64 and r["gen_tokens_per_s"] > 0
        # the weighted total: exact match (0 at random init) + 0.5 x the letters' share
        assert abs(r["reward"] - 0.5 * r[f"rewards/{letters}/mean"] - r["rewards/exact_match/mean"]) < 1e-9
    assert records[0]["loss"] != 0 and "kl" not in records[0]  # real advantages; beta 0: no KL
    assert "start_eval_reward" in records[0] and "eval_reward" in records[-1]
    assert "reward " in proc.stdout and "zero_std " in proc.stdout and "gen " in proc.stdout
    assert f"held-out exact_match (greedy): before 0.0% -> after {records[-1]['eval_rewards/exact_match']:.1%}" \
        in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_grpo_learns_a_reward_through_the_cli(tmp_path):
    """Learning, end to end: the recipe as shipped (random init, its lr, 16 completions at temperature 0.7) with a
    format reward (1 when the completion starts with `a`; ~1 draw in 128 at random init) for 10 steps. Sampled and
    rewarded `a`s make `a` the greedy first token: the printed held-out line goes from 0% to 100% (100% from step 5
    on, measured), and the step's mean reward rises with it. The recipe's own task (reversal, exact match from a
    warm-up) learns too slowly for the suite: its measured run is in its header and docs/grpo.md."""
    run = tmp_path / "run"
    proc = cli("train", "tiny-grpo-cpu", f"train.output_dir={run}", "data.num_samples=200", "train.max_steps=10",
               "grpo.reward_funcs=[format:a.*]", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("held-out "))
    before, after = (float(x) for x in re.fullmatch(
        r"held-out format:a\.\* \(greedy\): before ([\d.]+)% -> after ([\d.]+)%", line).groups())
    assert (before, after) == (0.0, 100.0), line
    rewards = [r["reward"] for r in metrics(run)]
    assert len(rewards) == 10 and rewards[0] < 0.05 and rewards[-1] > 4 * rewards[0] + 0.1, rewards
