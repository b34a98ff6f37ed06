"""`shardtune plan` vs measured peak memory on CPU, over the validation grid (tests/plan_accuracy.py).

    .venv/bin/python bench/plan_accuracy.py            # ~13 configurations, world sizes 1/2/4, ~3 min on 2 cores
    .venv/bin/python bench/plan_accuracy.py --qlora    # the separate QLoRA table (6 configurations)
    .venv/bin/python bench/plan_accuracy.py --vocab    # 32k vocabulary, chunked loss / tiled NF4 on and off (8)
    .venv/bin/python bench/plan_accuracy.py --demo     # + the demo recipes (tiny-cpu, tiny-lora-cpu) x micro-batch
                                                       #   1/2/4/8 x full_shard/shard_grad_op/no_shard x 1/2/4 ranks

Prints a markdown table (predicted, measured = max over steps of `peak_mem_bytes` from `train.profile_memory=true`,
error) and the worst error. Goal: within +-5 %.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/

from tests.plan_accuracy import default_grid, demo_grid, qlora_grid, run, vocab_grid  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="*", help="only these world sizes")
    parser.add_argument("--qlora", action="store_true", help="only the QLoRA table (lora.quantize_base=nf4)")
    parser.add_argument("--vocab", action="store_true", help="only the 32k-vocabulary table (chunked loss, tiled "
                        "NF4 on and off)")
    parser.add_argument("--demo", action="store_true", help="also the demo-recipe grid (72 runs), a separate table")
    parser.add_argument("--demo-only", action="store_true", help="only the demo-recipe grid")
    args = parser.parse_args()
    if args.qlora:
        tables = [("QLoRA table (issue 11)", qlora_grid())]
    elif args.vocab:
        tables = [("32k vocabulary: chunked loss, tiled NF4 (issue 21)", vocab_grid())]
    else:
        tables = [] if args.demo_only else [("validation grid (own 4-layer Llama)", default_grid())]
        if args.demo or args.demo_only:
            tables.append(("demo recipes as shipped (issue 12)", demo_grid()))
    for title, grid in tables:
        print(f"\n### {title}\n")
        _table([c for c in grid if not args.world or c.world in args.world])


def _table(cases) -> None:
    t0 = time.perf_counter()
    rows = run(cases)
    print("| configuration | predicted MB | measured MB | error |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['predicted'] / 1e6:.2f} | {r['measured'] / 1e6:.2f} | {r['error']:+.1%} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nworst error: {worst['error']:+.1%} ({worst['name']}); {len(rows)} configurations, "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
