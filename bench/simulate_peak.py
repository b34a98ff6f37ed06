"""Where `plan --simulate` peaks, beside the plan's phases: the autograd node running at the peak, and the live
storages there grouped by the op, shape and dtype that made them (engine_vs_fsdp2.py `print_peak_list`).

    PYTHONPATH=src .venv/bin/python bench/simulate_peak.py llama-3.1-8b-qlora-128k-1x24gb [KEY=VALUE ...]
    PYTHONPATH=src .venv/bin/python bench/simulate_peak.py llama-3.1-8b-qlora-128k-1x24gb --chunk-final-norm

The plan names its peak phase; the simulation gives one number. This says which part of the step the simulated
peak is in, so a plan that is right by two errors cancelling shows it (bench/RESULTS.md, stop 55).
`--chunk-final-norm`: an experiment, not a product option: the model's final RMSNorm runs over 4,096-token
checkpointed chunks (model/tiled_mlp.py chunked_forward, as the blocks' norms under engine.mlp_chunk_tokens), to
see the step's peak once the final norm's backward is no longer it. ~1 min at 8B on 2 cores.
"""
from __future__ import annotations

import functools
import sys

import torch
from engine_vs_fsdp2 import print_peak_list  # bench/, this script's folder

import shardtune.simulated.allocator as allocator
import shardtune.trainer.parallelize as parallelize
from shardtune.model.tiled_mlp import chunked_forward
from shardtune.plan.planner import make_plan
from shardtune.plan.simulate import simulate

GIB = 2 ** 30
TRACKERS: list[allocator.AllocatorTracker] = []
AT_PEAK: dict[str, str] = {}


class PeakRecorder(allocator.AllocatorTracker):
    """The simulation's tracker, keeping the live storages and the autograd node at each new peak."""

    def __init__(self, **kwargs) -> None:
        super().__init__(record_peak=True, **kwargs)
        TRACKERS.append(self)

    def _add(self, key: int, delta: int) -> None:
        before = self._peak
        super()._add(key, delta)
        if self._peak > before:
            node = torch._C._current_autograd_node()
            AT_PEAK["node"] = node.name() if node is not None else "(forward, or outside autograd)"


def chunk_final_norm(apply_checkpointing):
    @functools.wraps(apply_checkpointing)
    def wrapped(model, *args, **kwargs):
        for name, module in model.named_modules():
            if name.endswith("model.norm") and ".layers." not in name:
                module.forward = functools.partial(chunked_forward, module.forward, chunk_tokens=4096)
        return apply_checkpointing(model, *args, **kwargs)
    return wrapped


def main(recipe: str, overrides: list[str], chunk_final: bool) -> None:
    allocator.AllocatorTracker = PeakRecorder  # simulate() imports it at its call
    if chunk_final:
        parallelize.apply_activation_checkpointing = chunk_final_norm(parallelize.apply_activation_checkpointing)
    plan = make_plan(recipe, overrides)
    for phase, parts in plan.estimate.breakdown.items():
        detail = "  ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
        print(f"plan {phase:14s} {sum(parts.values()) / GIB:7.2f} GiB   {detail}")
    del plan  # its meta skeleton would be counted as live
    sim = simulate(recipe, overrides)
    tracker = TRACKERS[-1]
    print(f"simulated peak {sim.device_peak / GIB:.2f} GiB (ratio {sim.ratio:.3f}) at {tracker.peak_op}, "
          f"autograd node {AT_PEAK.get('node')}")
    print_peak_list("the simulated step", tracker.peak_live, 24)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], [a for a in args[1:] if "=" in a], "--chunk-final-norm" in args)
