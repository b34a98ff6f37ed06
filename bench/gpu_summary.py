"""The table for bench/RESULTS.md from a bench/gpu_session.sh run: per run, tokens/s and the measured peak
(`torch.cuda.max_memory_allocated` through train.profile_memory) against `shardtune plan --json` for the same
recipe and overrides (the plan runs here, on the CPU: it builds the model on the meta device).

    .venv/bin/python bench/gpu_summary.py gpu_out
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

GiB = 2**30
SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))


def planned_peak(recipe: str, overrides: list[str]) -> int | None:
    proc = subprocess.run([SHARDTUNE, "plan", recipe, *overrides, "--json"], capture_output=True, text=True)
    if proc.returncode not in (0, 3):  # 3: does not fit, still a plan
        return None
    return json.loads(proc.stdout)["per_rank"]["total_bytes"]


def main(out: Path) -> None:
    print("| run | steps | tokens/s (median, steps 2+) | peak allocated GiB | plan GiB | measured / plan | loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for line in (out / "runs.tsv").read_text().splitlines():
        name, recipe, overrides = line.split("\t")
        path = out / f"{name}.jsonl"
        plan = planned_peak(recipe, overrides.split())
        plan_s = f"{plan / GiB:.2f}" if plan else "-"
        if not path.exists():
            print(f"| {name} | failed | - | - | {plan_s} | - | - |")
            continue
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "tokens_per_s" in r]
        tps = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
        peak = max(r.get("peak_mem_bytes") or 0 for r in rows)
        ratio = f"{peak / plan:.3f}" if plan else "-"
        print(f"| {name} | {len(rows)} | {tps:,.0f} | {peak / GiB:.2f} | {plan_s} | {ratio} | "
              f"{rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
