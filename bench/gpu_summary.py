"""The markdown table of a bench/gpu_session.sh run (bench/RESULTS.md's GPU section says what each column means).

The session writes, per run NAME, into one folder: a line of runs.tsv (name, method, status, recipe, overrides),
NAME.jsonl (the run's metrics.jsonl), NAME.plan.json (`shardtune plan ... --json`) and NAME.sim.json
(`shardtune plan ... --simulate --json`, for the roofline). Any of the last three may be missing: that cell reads "-".

    .venv/bin/python bench/gpu_summary.py gpu_out/raw        # prints the table
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2  # steps left out of the median: the first allocations, autotuning, compilation
COLUMNS = ["run", "method", "status", "measured steps", "tokens/s", "MFU %", "peak GiB", "plan GiB",
           "peak / plan", "roofline tokens/s", "roofline verdict", "loss first -> last"]


def flops_per_token(method: str, *, params: int, lora_params: int, embedding_params: int) -> float:
    """Model FLOPs per trained token, forward + backward, activation recomputation and attention's
    sequence-squared term not counted (MFU, not hardware utilisation). N = matmul parameters: all but an untied
    input embedding, which is a lookup. Full fine-tuning: 6 N (forward 2 N, input and weight gradients 4 N).
    LoRA and QLoRA: the frozen base needs forward and input gradient only, 4 N, and the adapters 6 N_lora
    (the NF4 dequantization of QLoRA is not counted)."""
    base = params - lora_params - embedding_params
    if method == "full":
        return 6.0 * base
    assert method in ("lora", "qlora"), method
    return 4.0 * base + 6.0 * lora_params


def embedding_params(model_config: Path) -> int:
    """An untied input embedding's parameters (no FLOPs); 0 when tied, because then it is also the output head."""
    cfg = json.loads(model_config.read_text())
    return 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"]


def peak_tflops(gpu: str) -> float | None:
    path = ROOT / "configs" / "hardware" / f"{gpu}.yaml"
    return yaml.safe_load(path.read_text()).get("bf16_tflops") if path.exists() else None


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _override(overrides: list[str], key: str) -> str | None:
    hits = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return hits[-1] if hits else None


def row(out: Path, name: str, method: str, status: str, overrides: list[str]) -> dict[str, str]:
    cells = dict.fromkeys(COLUMNS, "-")
    cells.update(run=name, method=method, status=status)
    metrics = out / f"{name}.jsonl"
    steps = []
    if metrics.exists():
        steps = [r for r in (json.loads(x) for x in metrics.read_text().splitlines() if x.strip())
                 if "tokens_per_s" in r]
    plan = _load(out / f"{name}.plan.json")
    sim = _load(out / f"{name}.sim.json")
    plan_bytes = plan["per_rank"]["total_bytes"] if plan else None
    if plan_bytes:
        cells["plan GiB"] = f"{plan_bytes / GiB:.2f}"
    roofline = (sim or {}).get("roofline")
    if roofline:
        cells["roofline tokens/s"] = f"{roofline['tokens_per_s']:,.0f}"
        cells["roofline verdict"] = roofline["verdict"]
    if not steps:
        return cells
    measured = steps[WARMUP_STEPS:] or steps[-1:]
    tps = statistics.median(r["tokens_per_s"] for r in measured)
    cells["measured steps"] = str(len(measured)) if len(steps) > WARMUP_STEPS else f"{len(measured)} (no warm-up)"
    cells["tokens/s"] = f"{tps:,.0f}"
    cells["loss first -> last"] = f"{steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}"
    peaks = [r["peak_mem_bytes"] for r in steps if r.get("peak_mem_bytes") is not None]
    if peaks:
        cells["peak GiB"] = f"{max(peaks) / GiB:.2f}"
        if plan_bytes:
            cells["peak / plan"] = f"{max(peaks) / plan_bytes:.3f}"
    gpu, config = _override(overrides, "hardware.gpu"), _override(overrides, "model.config")
    peak = peak_tflops(gpu) if gpu else None
    if plan and peak and config:
        flops = flops_per_token(method, params=plan["model"]["params"], lora_params=plan["model"]["lora_params"],
                                embedding_params=embedding_params(ROOT / config))
        cells["MFU %"] = f"{100 * flops * tps / (peak * 1e12):.1f}"
    return cells


def table(out: Path) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    runs = out / "runs.tsv"
    for line in (runs.read_text().splitlines() if runs.exists() else []):
        name, method, status, _recipe, overrides = line.split("\t")
        cells = row(out, name, method, status, overrides.split())
        lines.append("| " + " | ".join(cells[c] for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table(Path(sys.argv[1])))
