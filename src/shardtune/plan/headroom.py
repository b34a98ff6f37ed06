"""The headroom rule: a plan that fits by less than 3 % of usable memory gets one advice line naming the knob to turn.

A recipe that fits by 15 MB runs out of memory on a card whose driver, allocator state or kernels' workspaces differ a
little from the plan's (the one GPU measurement read LoRA and QLoRA at 1.09x and 1.15x of the plan). `plan` and the
train pre-flight both print the line; every shipped recipe keeps the 3 % (tests/unit/plan/test_plan.py).

The knob: of the single changes that keep what is trained (the same model, adapters and global batch; only how the
step is cut up or where its states live), the fastest by plan/search.py's step time that restores 3 %; the longest
data.seq_len that does when none of them does.
"""
from __future__ import annotations

from shardtune.plan.hardware import GiB
from shardtune.plan.result import MIN_HEADROOM, Plan, variant

MIN_CHUNK = 128  # tokens: engine.mlp_chunk_tokens and train.loss_chunk_tokens are not halved below this


def _keeps_headroom(plan: Plan) -> bool:
    return plan.fits and not plan.low_headroom


def _candidates(plan: Plan) -> list[tuple[str, Plan]]:
    """(override, plan) for each single change that cuts memory without changing what is trained."""
    s = plan.setup
    out: list[tuple[str, Plan]] = []
    tokens = s.micro_batch * s.local_seq
    if s.checkpointing is False:
        out.append(("engine.activation_checkpointing=true", variant(plan, checkpointing=True)))
    if s.micro_batch > 1:
        mb = s.micro_batch // 2
        ga = s.grad_accum * s.micro_batch // mb
        out.append((f"train.micro_batch_size={mb} train.grad_accum={ga}", variant(plan, micro_batch=mb, grad_accum=ga)))
    mlp = s.mlp_chunk if 0 < s.mlp_chunk < tokens else tokens
    if mlp // 2 >= MIN_CHUNK:
        out.append((f"engine.mlp_chunk_tokens={mlp // 2}", variant(plan, mlp_chunk=mlp // 2)))
    if s.loss_chunk // 2 >= MIN_CHUNK:
        out.append((f"train.loss_chunk_tokens={s.loss_chunk // 2}", variant(plan, loss_chunk=s.loss_chunk // 2)))
    if s.checkpointing is not False and not s.offload_activations:
        out.append(("engine.offload_activations=true", variant(plan, offload_activations=True)))
    if not s.offload:
        out.append(("engine.cpu_offload=true", variant(plan, offload=True)))
    return out


def _longest_seq(plan: Plan) -> Plan | None:
    """The longest data.seq_len under the recipe's (a multiple of 128 tokens per rank) that keeps the headroom."""
    s = plan.setup
    step = 128 * s.context_parallel
    lo, hi = 0, s.seq_len // step  # in steps: lo keeps the headroom (0: none found), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _keeps_headroom(variant(plan, seq_len=mid * step)):
            lo = mid
        else:
            hi = mid
    return variant(plan, seq_len=lo * step) if lo else None


def headroom_advice(plan: Plan) -> list[str]:
    """One advice line when the plan fits with under MIN_HEADROOM of usable memory left; else none."""
    if not plan.low_headroom:
        return []
    from shardtune.plan.search import step_time

    fixes = [(step_time(p)["step_s"], text, p) for text, p in _candidates(plan) if _keeps_headroom(p)]
    if fixes:
        _, text, p = min(fixes, key=lambda f: f[0])
    elif (p := _longest_seq(plan)) is not None:
        text = f"data.seq_len={p.setup.seq_len}"
    else:
        text, p = "run `shardtune plan RECIPE --fit` for a configuration with more room", None
    fix = f"{text}: peak {p.estimate.total / GiB:.1f} GiB of {plan.usable / GiB:.1f} GiB usable" if p else text
    return [f"headroom {plan.headroom / GiB:.2f} GiB is {plan.headroom / plan.usable:.1%} of usable, under "
            f"{MIN_HEADROOM:.0%}: another card, driver or allocator state can run out of memory; for {MIN_HEADROOM:.0%}: "
            f"{fix}"]
