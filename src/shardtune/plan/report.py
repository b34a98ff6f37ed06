"""How a Plan is shown: a rich table for people, the `--json` dict for scripts, a stacked-bar PNG."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardtune.config.dtypes import DTYPE_NAMES
from shardtune.plan import grpo
from shardtune.plan.estimate import CATEGORIES
from shardtune.plan.hardware import GiB
from shardtune.plan.result import Plan

LABELS = {"params": "params (sharded)", "grads": "grads (sharded + in flight)", "optimizer": "optimizer (AdamW)",
          "gathered": "gathered units + comm/temp buffers", "activations": "activations (incl. fp32 logits + grad)",
          "buffers": "module buffers"}


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f}"


def summary_line(plan: Plan) -> str:
    e = plan.estimate
    verdict = "fits" if plan.fits else "does NOT fit"
    return (f"{verdict}: peak {e.total / GiB:.2f} GiB/rank ({e.peak_phase}) vs {plan.usable / GiB:.2f} GiB usable "
            f"of {plan.capacity / GiB:.2f} GiB {plan.checks_against if plan.hardware.is_cpu else plan.hardware.key}; "
            f"host {e.host_bytes / GiB:.1f} GiB/node")


def speed_line(plan: Plan) -> str:
    """What a GPU would wait on, estimated without a simulated step (plan/search.py step_time: the GPU's time and
    the host's, estimated kernel launches x the time per launch); `plan --simulate` counts the launches."""
    from shardtune.plan.roofline import HOST_S_PER_LAUNCH, estimated_launches
    from shardtune.plan.search import step_time

    t = step_time(plan)
    bound = "host-bound" if t["host_s"] > t["gpu_s"] else "GPU-bound"
    return (f"{bound} (estimated, --simulate counts): host {t['host_s']:.2f} s (~{estimated_launches(plan):,} "
            f"launches x {HOST_S_PER_LAUNCH * 1e6:.0f} us) vs GPU {t['gpu_s']:.2f} s per step; "
            f"~{t['tokens_per_s']:,.0f} tokens/s")


def print_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    e, s = plan.estimate, plan.setup
    compute = DTYPE_NAMES[s.compute]
    console.print(f"[bold]{plan.stats.num_params:,}[/] params ({e.trainable_params:,} trainable), "
                  f"{len(e.units)} units; world {s.world} ({s.nodes} node(s)), shard group {s.shard_size}, "
                  f"{s.strategy}, {compute} compute, "
                  f"checkpointing={s.checkpointing}, offload={s.offload}, lora={s.lora}"
                  f"{' (nf4 base)' if s.nf4 and s.lora else ''}, "
                  f"micro-batch {s.micro_batch} x seq {s.seq_len}"
                  f"{f' (context parallel: {s.local_seq} tokens per rank)' if s.context_parallel > 1 else ''}")
    if plan.stats.recipe.train.objective == "dpo":
        console.print(dpo_line(plan.stats.recipe))
    if grpo.is_grpo(plan.stats) and "generate" in e.phases:
        console.print(grpo.grpo_line(plan.stats, s, e.phases, s.compute.itemsize))
    if s.nf4 and s.lora:
        from shardtune.plan.result import quantized_summary

        q = quantized_summary(e)
        unquantized = f"{s.compute.itemsize * q['weights'] / GiB:.2f} GiB {compute}"  # the base without nf4
        console.print(f"NF4 base (lora.quantize_base=nf4): {q['weights']:,} weights of the decoder blocks' "
                      f"{', '.join(q['modules'])} in {q['bytes'] / GiB:.2f} GiB of 4-bit codes + scales "
                      f"({q['per_rank_bytes'] / GiB:.2f} GiB/rank, padded to whole blocks) instead of "
                      f"{unquantized}; dequantized per matmul; {q['unquantized']} unquantized")
    table = Table(title=f"per-rank peak memory ({e.peak_phase})")
    table.add_column("category")
    table.add_column("GiB", justify="right")
    table.add_column("% of capacity", justify="right")
    for k in CATEGORIES:
        b = e.per_rank[f"{k}_bytes"]
        table.add_row(LABELS[k], _gib(b), f"{b / plan.capacity:.1%}")
    table.add_section()
    table.add_row("[bold]total (peak)[/]", f"[bold]{_gib(e.total)}[/]", f"{e.total / plan.capacity:.1%}")
    table.add_row("usable (all of it: no CUDA context on the host)" if plan.hardware.is_cpu else
                  "usable (capacity less CUDA context and allocator slack)", _gib(plan.usable),
                  f"{plan.usable / plan.capacity:.1%}")
    table.add_row(f"capacity ({plan.checks_against})", _gib(plan.capacity), "100.0%")
    table.add_row("headroom", _gib(plan.headroom), f"{plan.headroom / plan.capacity:.1%}")
    if s.offload or e.host_bytes:
        ram = plan.recipe.hardware.host_ram_gb
        table.add_row("host RAM per node (offloaded states)", _gib(e.host_bytes),
                      f"of {ram:g} GiB" if ram else "")
    console.print(table)
    phases = ", ".join(f"{k} {v / GiB:.2f}" for k, v in e.phases.items())
    console.print(f"phases (GiB): {phases}")
    style = "green" if plan.fits else "red"
    console.print(f"[{style}]{summary_line(plan)}[/]")
    if not plan.setup.device_is_cpu:
        console.print(speed_line(plan), soft_wrap=True)
    for a in plan.advice:
        console.print(f"  advice: {a}")


def write_png(plan: Plan, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = plan_figure(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_figure(plan: Plan):  # -> matplotlib.figure.Figure (matplotlib loads only for --png)
    """Stacked bars: one per phase of the step, categories stacked, capacity and usable as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = plan.estimate.breakdown
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(phases)
    bottom = [0.0] * len(names)
    for k in CATEGORIES:
        vals = [phases[p].get(k, 0) / GiB for p in names]
        ax.bar(names, vals, bottom=bottom, label=LABELS[k])
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax.axhline(plan.capacity / GiB, color="black", linestyle="-", label=f"capacity {plan.capacity / GiB:.1f} GiB")
    ax.axhline(plan.usable / GiB, color="red", linestyle="--", label=f"usable {plan.usable / GiB:.1f} GiB")
    ax.set_ylabel("GiB per rank")
    where = (f"in {plan.checks_against}" if plan.hardware.is_cpu else
             f"on {plan.setup.world} x {plan.hardware.key}")
    ax.set_title(f"{Path(plan.recipe.model.config or plan.recipe.model.path or '').stem}: "
                 f"{'fits' if plan.fits else 'does not fit'} {where}", fontsize=10)
    # nine or ten phase names side by side overlap on one line: one line per part of a name
    ax.set_xticks(range(len(names)), [n.replace("-", "-\n") for n in names])
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def dpo_line(r) -> str:
    """How the plan counts a DPO recipe's reference (both options)."""
    b = r.train.micro_batch_size
    pre = r.dpo.precompute_reference
    precompute = (not r.lora.enabled or r.dpo.sft_warmup_steps > 0) if pre is None else pre
    ref = ("precomputed: one no-grad pass over every pair when DPO starts, 8 B/pair on the host, no model copy, no "
           "extra forward per step" if precompute else
           "the base with the adapters off: one extra no-grad forward of the same rows per micro-step (+~1/3 "
           "compute), freed before the policy forward, so no resident memory")
    return f"DPO: micro-batch {b} pair(s) = {2 * b} rows in one forward (chosen + rejected); reference {ref}"
