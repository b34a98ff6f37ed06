"""QLoRA vs bf16-base LoRA vs FSDP2 with the same NF4 base, on the tiny-qlora-cpu recipe (2 CPU workers).

    .venv/bin/python bench/qlora.py            # three short runs through the real CLI, ~5 min on 2 busy cores

Each run: `shardtune train tiny-qlora-cpu` with train.profile_memory=true (the CPU tracker slows every run alike),
6 steps, in the configuration of the published table (bench/RESULTS.md): bf16 compute, activation checkpointing,
r=8 (the 70B QLoRA recipes' path; the recipe itself ships fp32 compute and r=32 so that it learns quickly on CPU). Reports the median step time over steps 2..6, the max peak_mem_bytes, and comm_bytes per step (ours: the
all-gathers of the base + one adapter all-reduce; FSDP2 exposes no counter). Ratios are against the QLoRA run.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
COMMON = ["data.num_samples=300", "train.max_steps=6", "train.demo_eval=false", "train.eval_every=0",
          "train.save_every=0", "train.save_final=false", "train.warmup_steps=0", "train.profile_memory=true",
          "engine.mixed_precision=bf16", "engine.activation_checkpointing=true", "lora.r=8", "lora.alpha=16"]
RUNS = {"qlora (nf4 base, ours)": [], "lora (bf16 base, ours)": ["lora.quantize_base=null"],
        "qlora (nf4 base, FSDP2)": ["engine.backend=torch"]}


def run(name: str, extra: list[str], tmp: Path) -> dict:
    out = tmp / name.split()[0].replace("(", "") / str(len(extra))
    proc = subprocess.run([SHARDTUNE, "train", "tiny-qlora-cpu", f"train.output_dir={out}", *COMMON, *extra],
                          capture_output=True, text=True, cwd=tmp)
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "step_time_s" in r]
    return {"name": name, "step_s": statistics.median(r["step_time_s"] for r in steps[1:]),
            "peak": max(r.get("peak_mem_bytes", 0) for r in steps),
            "comm": statistics.median(r.get("comm_bytes") or -1 for r in steps[1:]), "loss": steps[-1]["loss"]}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        res = [run(n, e, Path(tmp)) for n, e in RUNS.items()]
    ref = res[0]
    print("| run | step time s | vs qlora | peak MB | vs qlora | comm MB/step | last loss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in res:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} | | | | | |")
            continue
        comm = f"{r['comm'] / 1e6:.2f}" if r["comm"] >= 0 else "n/a"
        print(f"| {r['name']} | {r['step_s']:.2f} | {r['step_s'] / ref['step_s']:.2f}x | {r['peak'] / 1e6:.2f} | "
              f"{r['peak'] / ref['peak']:.2f}x | {comm} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
