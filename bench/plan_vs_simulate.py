"""`shardtune plan` against `shardtune plan --simulate`, for every recipes/hardware recipe in three variants:

  as is     the recipe as shipped;
  hybrid    engine.strategy=hybrid_shard engine.cpu_offload=true launch.nnodes=2, hardware.num_gpus = 2 x the
            recipe's GPUs per node (the same nodes, two of them);
  torch     engine.backend=torch.

    PYTHONPATH=src .venv/bin/python bench/plan_vs_simulate.py                 # run what is missing, print the table
    PYTHONPATH=src .venv/bin/python bench/plan_vs_simulate.py --only llama-3.1-8b-lora-1x24gb --variant torch
    PYTHONPATH=src .venv/bin/python bench/plan_vs_simulate.py --table         # only the table, from saved runs

Each combination is one `shardtune plan RECIPE OVERRIDES --simulate --json` process, run one at a time (minutes each
at 70B and up on 2 cores); its JSON (or its refusal) is saved under --out and reused on the next call. Columns:
the plan's device peak beside the simulated live-tensor peak, the caching allocator's allocated and reserved peaks
(simulated/allocator.py), the host peak beside the plan's host bytes, the ratios, and the wall time. A combination
the product refuses is listed with its one-line error. Goal: each ratio within +-5 %.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
HARDWARE = REPO / "recipes" / "hardware"
GIB = 2 ** 30


def variants(recipe: Path) -> dict[str, list[str]]:
    raw = yaml.safe_load(recipe.read_text())
    gpus = int(raw.get("hardware", {}).get("num_gpus", 1))
    nodes = int(raw.get("launch", {}).get("nnodes", 1))
    per_node = max(1, gpus // nodes)
    return {"as is": [],
            "hybrid": ["engine.strategy=hybrid_shard", "engine.cpu_offload=true", "launch.nnodes=2",
                       f"hardware.num_gpus={2 * per_node}"],
            "torch": ["engine.backend=torch"]}


def _slug(recipe: Path, variant: str) -> str:
    return f"{recipe.stem}__{variant.replace(' ', '_')}"


def run_one(recipe: Path, overrides: list[str], out: Path, timeout: int) -> dict:
    cmd = ["shardtune", "plan", str(recipe.relative_to(REPO)), *overrides, "--simulate", "--json"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        result = {"command": " ".join(cmd), "status": "timeout", "wall_total_s": timeout}
    else:
        result = {"command": " ".join(cmd), "wall_total_s": round(time.perf_counter() - t0, 1),
                  "returncode": proc.returncode}
        if proc.returncode == 0:
            result.update(status="ok", **json.loads(proc.stdout))
        else:
            lines = proc.stderr.strip().splitlines()
            # The product's refusal is one line (exit 2); anything else is a failure worth showing whole.
            result.update(status="refused" if proc.returncode == 2 and len(lines) == 1 else "failed",
                          stderr=proc.stderr[-4000:])
    out.write_text(json.dumps(result, indent=2))
    return result


def _plan_figures(recipe: Path, overrides: list[str]) -> dict:
    from shardtune.plan.planner import make_plan

    plan = make_plan(str(recipe), overrides)
    # the step's peak, as plan --simulate compares (FSDP2's whole-model load is a setup phase the step does not see)
    step = max(v for k, v in plan.estimate.phases.items() if k != "load")
    return {"analytic_peak_bytes": step, "analytic_host_bytes": plan.estimate.host_per_rank}


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else ("-" if not a else "inf")


def row(name: str, variant: str, r: dict) -> str:
    if r["status"] != "ok":
        why = (r.get("stderr") or r["status"]).strip().splitlines()[-1][:160] if r.get("stderr") else r["status"]
        return f"| {name} | {variant} | {r['status']}: {why} | | | | | | | | {r.get('wall_total_s', '')} |"
    plan, sim = r["analytic_peak_bytes"], r["simulated_peak_bytes"]
    hp, hs = r["analytic_host_bytes"], r["simulated_host_bytes"]
    return (f"| {name} | {variant} | {plan / GIB:.2f} | {sim / GIB:.2f} | {_ratio(sim, plan)} "
            f"| {r['allocator_allocated_peak_bytes'] / GIB:.2f} | {r['allocator_reserved_peak_bytes'] / GIB:.2f} "
            f"| {hp / GIB:.2f} | {hs / GIB:.2f} | {_ratio(hs, hp)} | {r['wall_total_s']} |")


HEADER = ("| recipe | variant | plan GiB | simulated GiB | ratio | allocated GiB | reserved GiB | plan host GiB "
          "| simulated host GiB | host ratio | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/plansim"), help="where each run's JSON is kept")
    parser.add_argument("--only", nargs="*", help="recipe stems to run (default: all)")
    parser.add_argument("--variant", nargs="*", choices=["as is", "hybrid", "torch"], help="variants (default: all)")
    parser.add_argument("--table", action="store_true", help="run nothing: the table from the saved runs")
    parser.add_argument("--rerun", action="store_true", help="run again even when a saved run exists")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--replan", action="store_true", help="the plan columns from this checkout's plan (cheap: no "
                        "simulation), beside the saved simulations")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe in sorted(HARDWARE.glob("*.yaml")):
        if args.only and recipe.stem not in args.only:
            continue
        for variant, overrides in variants(recipe).items():
            if args.variant and variant not in args.variant:
                continue
            path = args.out / f"{_slug(recipe, variant)}.json"
            if path.exists() and not args.rerun:
                result = json.loads(path.read_text())
            elif args.table:
                rows.append(f"| {recipe.stem} | {variant} | not run | | | | | | | | |")
                continue
            else:
                print(f"running {recipe.stem} {variant} ...", file=sys.stderr, flush=True)
                result = run_one(recipe, overrides, path, args.timeout)
            if args.replan and result["status"] == "ok":
                result = {**result, **_plan_figures(recipe, overrides)}
            rows.append(row(recipe.stem, variant, result))
    print(HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
