"""Our GRPO loss against TRL's own: `GRPOTrainer._compute_loss` (TRL 1.16 keeps the loss inside it) run unbound on
a stand-in trainer, on the same fixed log-probabilities, advantages and masks, in fp64 (1e-6).

The stand-in, the least fragile way we found: a SimpleNamespace holding the attributes `_compute_loss` reads,
copied from a real `GRPOConfig` as `GRPOTrainer.__init__` copies them (so epsilon_high=None -> epsilon and every
flag keeps TRL's default), with `args` the real config (an `args.*` flag TRL adds later reads its default), and
`_get_per_token_logps_and_entropies` a function returning our leaf log-probs. No TRL internals are patched, no
model or tokenizer is built; an attribute TRL starts reading is an AttributeError here, not a silent difference.
Advantages: TRL computes them inline in `_generate_and_score_completions` (a model, tokenizer and rewards to run),
so `_trl_advantages` holds its lines verbatim, on TRL's own `nanstd`."""
from __future__ import annotations

import tempfile
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from shardtune.trainer.grpo_loss import LOSS_TYPES, group_advantages, policy_loss, stats_means

trl = pytest.importorskip("trl")
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # GRPOConfig's

TOL = 1e-6
B, T, MAX_LEN = 4, 6, 8
LENGTHS = [6, 2, 4, 0]  # completion tokens per sequence; the empty one is a fully masked (truncated) completion
EPS_LOW, EPS_HIGH = 0.2, 0.28  # DAPO's clip-higher


def _data():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios beyond both clip bounds
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, -1.1, 0.5], dtype=torch.float64)
    mask = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()
    return logps, old, ref, adv, mask


def _config(loss_type: str, beta: float, **kw) -> GRPOConfig:
    return GRPOConfig(output_dir=tempfile.gettempdir(), report_to=[], use_cpu=True, loss_type=loss_type, beta=beta,
                      epsilon=EPS_LOW, epsilon_high=EPS_HIGH, max_completion_length=MAX_LEN, **kw)


def _stand_in(args: GRPOConfig, logps: torch.Tensor, *, grad_accum: int = 1):
    ident = lambda x: x  # noqa: E731  (one process: gathers and sum-reduces are the identity)
    acc = SimpleNamespace(num_processes=1, gather=ident, gather_for_metrics=ident, reduce=lambda x, reduction: x)
    per_token = lambda *a, **k: (logps, torch.zeros_like(logps), None)  # noqa: E731  (logps, entropies, aux)
    return SimpleNamespace(
        args=args, model=SimpleNamespace(training=True), accelerator=acc, current_gradient_accumulation_steps=grad_accum,
        loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        max_completion_length=args.max_completion_length, importance_sampling_level=args.importance_sampling_level,
        off_policy_mask_threshold=args.off_policy_mask_threshold, top_entropy_quantile=args.top_entropy_quantile,
        use_vllm=args.use_vllm, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        aux_loss_enabled=False, _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _get_per_token_logps_and_entropies=per_token)


def _trl_loss(args, logps, old, ref, adv, mask, *, num_items, grad_accum=1):
    """TRL's loss on these rows, differentiable in `logps`, and the metrics it logged."""
    me = _stand_in(args, logps, grad_accum=grad_accum)
    b, t = mask.shape
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "num_items_in_batch": torch.tensor(num_items)}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if args.beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(me, None, inputs), me._metrics["train"]


def _ours(loss_type, beta, logps, old, ref, adv, mask, *, num_items, num_sequences, kl_bias_correction=True):
    return policy_loss(logps, old, ref if beta else None, adv, mask, loss_type=loss_type, epsilon_low=EPS_LOW,
                       epsilon_high=EPS_HIGH, beta=beta, max_completion_length=MAX_LEN,
                       num_items_in_batch=num_items, num_sequences=num_sequences,
                       kl_bias_correction=kl_bias_correction)


def _grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("beta", "correct"), [(0.0, True), (0.04, True), (0.04, False)],
                         ids=["no_kl", "kl_corrected", "kl_k3"])  # TRL's use_bias_correction_kl (default True)
@pytest.mark.parametrize("with_old", [True, False], ids=["old_logps", "one_pass"])
def test_loss_gradient_and_stats_equal_trl(loss_type, beta, correct, with_old):
    base, old, ref, adv, mask = _data()
    old = old if with_old else None
    logps = base.clone().requires_grad_()
    ours, stats = _ours(loss_type, beta, logps, old, ref, adv, mask, num_items=int(mask.sum()), num_sequences=B,
                        kl_bias_correction=correct)
    trl_logps = base.clone().requires_grad_()
    args = _config(loss_type, beta, use_bias_correction_kl=correct)
    theirs, logged = _trl_loss(args, trl_logps, old, ref, adv, mask, num_items=int(mask.sum()))
    assert ours.item() != 0.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL)
    g_ours, g_trl = _grad(ours, logps), _grad(theirs, trl_logps)
    assert g_ours.abs().max() > 1e-3
    torch.testing.assert_close(g_ours, g_trl, rtol=0, atol=TOL)
    means = {k: float(v) for k, v in stats_means(stats).items()}
    want = {k: logged[k][-1] for k in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
            if k in logged}
    assert means == pytest.approx(want, abs=TOL)
    assert ("kl" in means) == (beta != 0.0)
    if with_old:  # the data do clip on both sides, so the ratios are compared where they are not 0
        assert means["clip_ratio/low_mean"] > 0 and means["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_halves_with_global_normalisers_equal_trl_accumulating_them(loss_type):
    """Two micro-batches (or ranks) of 2 sequences, each given the global counts: their losses and gradients sum to
    TRL's over the same two micro-batches with grad_accum 2 (dapo: one generation batch split in 2, TRL's
    num_items_in_batch the whole one's). For grpo, dr_grpo, dapo that is also the full batch's loss at once, for
    bnpo (a per-micro-batch token mean) it is not."""
    base, old, ref, adv, mask = _data()
    beta, n = 0.04, int(mask.sum())
    logps = base.clone().requires_grad_()
    halves = [_ours(loss_type, beta, logps[s], old[s], ref[s], adv[s], mask[s], num_items=n, num_sequences=B)[0]
              for s in (slice(0, 2), slice(2, 4))]
    split = halves[0] + halves[1]
    trl_logps = base.clone().requires_grad_()
    args = _config(loss_type, beta, gradient_accumulation_steps=2, steps_per_generation=2)
    trl_split = sum(_trl_loss(args, trl_logps[s], old[s], ref[s], adv[s], mask[s], num_items=n, grad_accum=2)[0]
                    for s in (slice(0, 2), slice(2, 4)))
    g_split = _grad(split, logps)
    torch.testing.assert_close(split, trl_split, rtol=0, atol=TOL)
    torch.testing.assert_close(g_split, _grad(trl_split, trl_logps), rtol=0, atol=TOL)

    full_logps = base.clone().requires_grad_()
    full, _ = _ours(loss_type, beta, full_logps, old, ref, adv, mask, num_items=n, num_sequences=B)
    if loss_type == "bnpo":  # halves of 8 and 4 tokens: the mean of two token means is not the token mean
        assert abs(split.item() - full.item()) > 1e-3
    else:
        torch.testing.assert_close(split, full, rtol=0, atol=TOL)
        torch.testing.assert_close(g_split, _grad(full, full_logps), rtol=0, atol=TOL)


def test_stats_sum_over_halves_to_the_full_batch():
    base, old, ref, adv, mask = _data()
    kw = dict(num_items=int(mask.sum()), num_sequences=B)
    _, full = _ours("dapo", 0.04, base, old, ref, adv, mask, **kw)
    parts = [_ours("dapo", 0.04, base[s], old[s], ref[s], adv[s], mask[s], **kw)[1] for s in (slice(0, 2), slice(2, 4))]
    assert full.keys() == parts[0].keys() and full["num_tokens"].item() == sum(LENGTHS)
    for k in full:
        torch.testing.assert_close(parts[0][k] + parts[1][k], full[k], rtol=0, atol=1e-12)


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16 `_generate_and_score_completions`, multi_objective_aggregation sum_then_normalize, verbatim."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [1, 4])
def test_group_advantages_equal_trl(scale_rewards, num_generations):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 3, (12,), generator=g).float() + torch.rand(12, generator=g)
    rewards[:4] = 0.5  # a group whose completions all score the same: advantages 0 (std + 1e-4)
    ours = group_advantages(rewards, num_generations, scale_rewards=scale_rewards)
    torch.testing.assert_close(ours, _trl_advantages(rewards, num_generations, scale_rewards), rtol=0, atol=TOL)
    if num_generations == 4:
        assert ours[:4].abs().max() == 0 and ours[4:].abs().max() > 0.1
        if scale_rewards == "group":  # each group of 4 lands on mean 0, std ~1
            assert float(ours[4:8].std()) == pytest.approx(1.0, abs=1e-3)


def test_bad_settings_are_value_errors_naming_the_key():
    logps, old, ref, adv, mask = _data()
    with pytest.raises(ValueError, match=r"grpo.loss_type: must be one of grpo, dr_grpo, dapo, bnpo, got 'ppo'"):
        _ours("ppo", 0.0, logps, old, ref, adv, mask, num_items=1, num_sequences=B)
    with pytest.raises(ValueError, match=r"grpo.beta=0.1: the KL term needs the reference log-probabilities"):
        policy_loss(logps, old, None, adv, mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.1,
                    max_completion_length=MAX_LEN, num_items_in_batch=1, num_sequences=B)
    with pytest.raises(ValueError, match=r"grpo.scale_rewards: must be one of group, batch, none, got 'std'"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")
