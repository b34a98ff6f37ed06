"""Kernel launches per optimizer step on the simulated GPU, ours against PyTorch FSDP2 (`engine.backend=torch`), side by
side: launches by phase, host syncs, host CPU-s (this machine's), and the roofline's verdict (plan/roofline.py).

    .venv/bin/python bench/launch_counts.py                 # every config below
    .venv/bin/python bench/launch_counts.py 1b-lora 8b-lora  # some of them

Each row is `shardtune plan RECIPE OVERRIDES --simulate --json` in its own process (what the command prints is what
the table holds), ours then FSDP2's, one after the other; "est.": `plan`'s analytic estimate of our launches
(plan/roofline.py estimated_launches), no simulated step. Prints a markdown table.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARDTUNE = str(REPO / ".venv/bin/shardtune")
PHASES = ("forward", "recompute", "backward", "optimizer", "communication")

# name -> (recipe, overrides, FSDP2 too)
CONFIGS = {
    "1b-lora": ("llama-3.1-8b-lora-1x24gb", ["model.config=configs/models/llama-3.2-1b.json", "data.seq_len=2048",
                                             "train.grad_accum=4"], True),  # the H200 run's shape
    "8b-lora": ("llama-3.1-8b-lora-1x24gb", ["data.seq_len=4096", "train.grad_accum=2"], True),
    "70b-qlora": ("llama-3.1-70b-qlora-2x24gb", ["data.seq_len=896", "train.grad_accum=2"], True),
    # FSDP2 takes no NF4 experts (engine/nf4_experts.py is ours)
    "qwen3-30b-a3b-qlora": ("qwen3-30b-a3b-qlora-1x24gb", ["data.seq_len=1024", "train.micro_batch_size=1",
                                                           "train.grad_accum=1"], False),
}


def simulate(recipe: str, overrides: list[str]) -> dict:
    cmd = [SHARDTUNE, "plan", recipe, *overrides, "--simulate", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def cell(sim: dict | None) -> str:
    if sim is None:
        return "– | – | – | –"
    n = sim["launches"]
    phases = " / ".join(f"{n['by_phase'][p]:,}" for p in PHASES)
    return f"**{n['total']:,}** ({phases}) | {len(sim['host_syncs'])} | {sim['host_cpu_s']:.2f} | " \
           f"{sim['roofline']['verdict']} ({sim['roofline']['host_s'] / sim['roofline']['gpu_s']:.1f}x)"


def estimated(recipe: str, overrides: list[str]) -> int:
    from shardtune.plan import make_plan
    from shardtune.plan.roofline import estimated_launches

    return estimated_launches(make_plan(recipe, overrides))


def main(names: list[str]) -> None:
    print("| config | ours: launches (fwd / recompute / bwd / optimizer / comm) | syncs | CPU-s | verdict (host/GPU) "
          "| FSDP2: launches (fwd / recompute / bwd / optimizer / comm) | syncs | CPU-s | verdict (host/GPU) | est. |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        recipe, overrides, fsdp2 = CONFIGS[name]
        ours = simulate(recipe, overrides)
        theirs = simulate(recipe, [*overrides, "engine.backend=torch"]) if fsdp2 else None
        print(f"| {name}: `{recipe} {' '.join(overrides)}` ({ours['roofline']['card']}) | {cell(ours)} | "
              f"{cell(theirs)} | {estimated(recipe, overrides):,} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CONFIGS))
