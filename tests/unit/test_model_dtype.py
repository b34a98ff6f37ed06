"""model.dtype=bf16 never makes bf16 master weights silently: a user error for full fine-tuning, fine under LoRA."""
from __future__ import annotations

import pytest

from shardtune.config.load import load_recipe
from shardtune.errors import UserError


def test_bf16_full_finetuning_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"model\.dtype.*master weights.*engine\.mixed_precision=bf16"):
        load_recipe("tiny-cpu", ["model.dtype=bf16"])


def test_bf16_base_under_lora_and_fp32_with_mixed_precision_are_accepted() -> None:
    assert load_recipe("tiny-cpu", ["model.dtype=bf16", "lora.enabled=true"]).model.dtype == "bf16"
    assert load_recipe("tiny-cpu", ["engine.mixed_precision=bf16"]).engine.mixed_precision == "bf16"
