"""`final/`: the trained model in HF format (or a PEFT adapter with LoRA), gathered unit by unit to rank 0."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune.engine.api import ShardedModel


def save_final(sharded: ShardedModel, hf_model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path,
               *, is_main: bool) -> None:
    """Collective: every rank iterates the state dict; rank 0 writes. Tied weights appear once (HF re-ties)."""
    state = {name: t.contiguous() for name, t in sharded.full_state_dict()}
    if not is_main:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")  # atomic: a crash never leaves a half-written model file
    hf_model.config.save_pretrained(out)
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
