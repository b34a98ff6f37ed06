"""The real engine and training step on the simulated GPU (meta device, fake NCCL-like group): forward, backward,
reduction, clipping, AdamW, a DCP save and a resume load, at world sizes 2, 4 and 8 (tests/simulated/steps.py).
A collective handed a host tensor, a host/device mix in an op, a pinned-memory mismatch or a fused AdamW on the
wrong device raises here, as it would on the first GPU run."""
from __future__ import annotations

import pytest

from tests.simulated import steps
from tests.simulated.harness import run_simulated

GROUPS = {  # 2 ranks: the cheap start, most settings; 4 and 8: the strategies whose groups depend on the world
    2: ["full_shard", "offload", "offload_bf16_accum", "lora", "lora_offload", "qlora", "qlora_offload", "torch"],
    4: ["shard_grad_op", "hybrid", "bf16_ac", "hybrid_offload"],
    8: ["no_shard", "hybrid"],
}


def test_settings_cover_the_brief():
    assert set(steps.SETTINGS) == {n for names in GROUPS.values() for n in names}


@pytest.mark.parametrize("world", sorted(GROUPS))
def test_train_step_save_resume(world, tmp_path):
    run_simulated(steps.run_settings, world, [{"base": str(tmp_path), "names": GROUPS[world]}])
