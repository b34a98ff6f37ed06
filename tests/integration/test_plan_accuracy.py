"""`plan` vs the real trainer's measured peak (train.profile_memory=true, CPU tracker) over >= 12 configurations:
world size 1/2/4 x strategy x precision x micro-batch x seq_len. Each prediction within +-5 %: the issue's
contract is +-10 %, but the grid sits within +-1.7 % and the CPU tracker is deterministic, so 5 % catches
regressions the looser bound would let through.

One spawn per world size runs all its configurations through `shardtune.trainer.train.train` (see tests/plan_accuracy.py).
"""
from __future__ import annotations

from tests.plan_accuracy import (
    DEMO_MICRO_BATCHES,
    DEMO_RECIPES,
    DEMO_STRATEGIES,
    DEMO_WORLDS,
    run,
    suite_tables,
)


def test_plan_predicts_measured_peak_within_5_percent(tmp_path) -> None:
    parts = suite_tables()
    cases, demo, qlora, dpo, vocab, long, moe = (rows for _, rows in parts)
    assert len(cases) >= 12 and {c.world for c in cases} == {1, 2, 4}
    # The demo recipes as shipped (issue 12): a subset covering every recipe, micro-batch, strategy and world size
    # (the full product is bench/plan_accuracy.py --demo). Same spawns as the grid: ~+20 s.
    covered = [{c.recipe for c in demo}, {o for c in demo for o in c.overrides}, {c.world for c in demo}]
    assert covered[0] == set(DEMO_RECIPES) and set(DEMO_WORLDS) == covered[2]
    assert {f"train.micro_batch_size={m}" for m in DEMO_MICRO_BATCHES} | {f"engine.strategy={s}" for s in
                                                                           DEMO_STRATEGIES} <= covered[1]
    # QLoRA (issue 11): NF4 byte buffers, gathered NF4 units, the dequantization transient; world 1/2/4 x
    # checkpointing on/off x bf16/fp32. All three tables share one spawn per world size.
    assert len(qlora) >= 6 and {c.world for c in qlora} == {1, 2, 4}
    # DPO (issue 24): 2 x micro-batch rows per forward, precomputed reference (full) / adapters-off forward (LoRA).
    assert {c.world for c in dpo} == {1, 2} and any("lora" in c.name for c in dpo)
    # Chunked loss and tiled NF4 (issue 21), each on and off, world 1/2/4 (an 8k vocabulary; the 32k table is
    # bench/plan_accuracy.py --vocab).
    on_off = [any(f"{k}=0" in o for o in c.overrides) for c in vocab for k in ("train.loss_chunk_tokens",)]
    assert len(vocab) >= 6 and any(on_off) and not all(on_off) and {c.world for c in vocab} == {1, 2, 4}
    # Long context: seq 8,192 on packed long documents, checkpointing, activation offloading, 1 and 2 ranks; context
    # parallelism at 4,096.
    cp = [c for c in long if "engine.context_parallel=true" in c.overrides]
    seqs = [[o for o in c.overrides if o.startswith("data.seq_len=")] for c in long]
    assert len(long) - len(cp) >= 6 and len(cp) == 2
    assert all(seq == (["data.seq_len=4096"] if c in cp else ["data.seq_len=8192"]) for c, seq in zip(long, seqs))
    # Mixture of experts: every expert's params, routed tokens' activations, NF4 experts, expert adapters.
    assert len(moe) >= 4 and {c.arch for c in moe} == {"moe"}
    rows = run([c for _, part in parts for c in part], tmp_path)
    tables, start = [], 0
    for title, part in parts:
        got, start = rows[start:start + len(part)], start + len(part)
        tables.append(f"{title}:\n" + "\n".join(f"{r['name']:<40} predicted {r['predicted']:>11,} measured "
                                                f"{r['measured']:>11,} {r['error']:+.1%}" for r in got))
    print("\n\n".join(tables))
    # Under-prediction (an OOM the plan said would fit) stays within 5 %. Over-prediction within 6 %: the LoRA row
    # "w2 full_shard bf16 mb1 s256 lora" reads +5.3 %: the plan charges every packed row the per-document attention's
    # second output copy (model/attention.py), which its peak, with a frozen bf16 o_proj, does not always hold; at seq 8192
    # under LoRA it does (-2.1 % with it, -5.2 % without).
    assert all(-0.05 <= r["error"] <= 0.06 for r in rows), "\n\n".join(tables)
