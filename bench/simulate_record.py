"""`plan --simulate` over a fixed set of cases in one process, every number of each `Simulation.to_json()` written
to a JSON file: run it from two trees and compare the files (all but `wall_s` should match) to check that a change
to the simulated GPU moved no byte.

    .venv/bin/python bench/simulate_record.py /tmp/after.json
"""
from __future__ import annotations

import json
import sys

from shardtune.plan.simulate import simulate

CASES = [("tiny-cpu", []), ("tiny-lora-cpu", []), ("tiny-moe-cpu", []),
         ("tiny-cpu", ["engine.mixed_precision=bf16", "engine.activation_checkpointing=true"]),
         ("tiny-cpu", ["engine.cpu_offload=true", "launch.nproc_per_node=2"]),
         ("tiny-lora-cpu", ["lora.quantize_base=nf4", "engine.mixed_precision=bf16"]),
         ("tiny-cpu", ["engine.backend=torch", "launch.nproc_per_node=2"]),
         ("qwen3-30b-a3b-lora-2x24gb", []), ("llama-3.1-8b-full-8x80gb", []), ("llama-3.1-70b-qlora-2x24gb", [])]


def main() -> None:
    out = {}
    for recipe, overrides in CASES:
        record = simulate(recipe, overrides).to_json()
        out[" ".join([recipe, *overrides])] = record
        print(recipe, overrides, f"{record['wall_s']} s", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
