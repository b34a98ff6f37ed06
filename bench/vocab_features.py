"""Issue 21 (chunked loss, tiled NF4, vocab_parallel, sharded adapter states): every recipes/hardware recipe planned
on the path before the issue, without vocab_parallel, without the sharded adapter states, and with the new
defaults, side by side, plus `plan --fit`'s fastest predicted tokens/s for each.

    .venv/bin/python bench/vocab_features.py              # a minute: plans only, nothing runs
    .venv/bin/python bench/vocab_features.py --simulate   # + each recipe's step on the simulated GPU (~5 min)

"before" is the recipe (and --fit's candidates) with `train.loss_chunk_tokens=0 engine.nf4_tile_mb=0
engine.vocab_parallel=false engine.shard_adapter_states=false` (the path before, which the plan models unchanged but
for the adapters' .grad between micro-steps, which the engine no longer holds); "no vp" only
`engine.vocab_parallel=false`; "no sas" only `engine.shard_adapter_states=false`; "after" is the recipe as shipped
(the new defaults). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from shardtune.bundled import RECIPES_DIR
from shardtune.plan import make_plan
from shardtune.plan.planner import GiB
from shardtune.plan.search import fit_search

OLD = ["train.loss_chunk_tokens=0", "engine.nf4_tile_mb=0", "engine.vocab_parallel=false",
       "engine.shard_adapter_states=false"]
NO_VP = ["engine.vocab_parallel=false"]
NO_SAS = ["engine.shard_adapter_states=false"]


def _row(recipe: str, overrides: list[str]) -> tuple[str, str]:
    plan = make_plan(recipe, overrides)
    found = fit_search(plan)
    if overrides == OLD:  # the search before the issue: the new features were not there to turn on
        found = [c for c in found if not c.plan.setup.loss_chunk and not c.plan.setup.nf4_tile_bytes]
    if "engine.vocab_parallel=false" in overrides:
        found = [c for c in found if not c.plan.setup.vocab_parallel]
    if "engine.shard_adapter_states=false" in overrides:
        found = [c for c in found if not c.plan.setup.shard_adapter_states]
    top = found[0].plan.setup if found else None
    best = (f"{found[0].time['tokens_per_s']:.0f} (mb {top.micro_batch}{', offload' if top.offload else ''})"
            if found else "nothing fits")
    return f"{plan.estimate.total / GiB:.2f}{'' if plan.fits else ' (no fit)'}", best


def _simulated(recipe: str) -> str:
    """The recipe as shipped, one step on the simulated GPU (`shardtune plan --simulate`), in its own process."""
    exe = str(Path(sys.executable).with_name("shardtune"))
    out = subprocess.run([exe, "plan", recipe, "--simulate", "--json"], capture_output=True, text=True)
    if out.returncode:
        return "failed"
    sim = json.loads(out.stdout)
    return f"{sim['simulated_peak_bytes'] / GiB:.2f} ({sim['ratio']:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate", action="store_true", help="add the simulated peak (and its ratio to the plan)")
    sim = ap.parse_args().simulate
    print("| recipe | peak before GiB | no vp GiB | no sas GiB | peak after GiB |"
          + (" simulated GiB (ratio) |" if sim else "") + " --fit tok/s before | no vp | no sas | after |")
    print("|---|---:|---:|---:|---:|" + ("---:|" if sim else "") + "---|---|---|---|")
    for path in sorted((RECIPES_DIR / "hardware").glob("*.yaml")):
        before, no_vp, no_sas, after = (_row(str(path), o) for o in (OLD, NO_VP, NO_SAS, []))
        simulated = f" {_simulated(str(path))} |" if sim else ""
        print(f"| {path.stem} | {before[0]} | {no_vp[0]} | {no_sas[0]} | {after[0]} |{simulated} {before[1]} | "
              f"{no_vp[1]} | {no_sas[1]} | {after[1]} |")


if __name__ == "__main__":
    main()
