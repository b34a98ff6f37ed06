"""`shardtune export CHECKPOINT OUT`: a sharded checkpoint -> HF safetensors (+ index), streamed tensor by tensor.

Each tensor is read alone from the DCP files (no process group, any world size) and appended to the current
output file; a file is written once it reaches `max_shard_bytes`. Peak memory: about one output file, never the
whole model.
"""
from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtune.checkpoint.generation import write_generation_config
from shardtune.checkpoint.paths import TRAINER_FILE, latest_checkpoint
from shardtune.checkpoint.writer import write_safetensors
from shardtune.errors import UserError
from shardtune.model.lora import ADAPTER_WEIGHTS, save_adapter


def _read_tensor(ckpt: Path, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    t = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # DCP says it reads without a process group: what no_dist asks for
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*", category=UserWarning)
        dcp.load({key: t}, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return t


def export_checkpoint(ckpt: Path, out: Path, *, max_shard_bytes: int = 2 * 1024**3,
                      progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """`progress(done_bytes, total_bytes, file_name)` after each tensor is read and after each file is written."""
    ckpt = latest_checkpoint(ckpt)
    info = json.loads((ckpt / TRAINER_FILE).read_text())
    shapes = json.loads((ckpt / "hf" / "params.json").read_text())
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    prefix = "replicated." if info.get("lora") else "model."
    keys = [k for k in metadata if k.startswith(prefix) and k[len(prefix):] in shapes]
    if not keys:
        raise UserError(f"export: no model tensors in '{ckpt}'")
    if info.get("lora"):
        return [_export_adapter(ckpt, out, keys, metadata, shapes)]

    def reader(k: str) -> Callable[[], torch.Tensor]:
        name = k[len(prefix):]
        return lambda: _read_tensor(ckpt, k, metadata[k]).view(shapes[name]["shape"])

    items = [(k[len(prefix):], metadata[k].size.numel() * metadata[k].properties.dtype.itemsize, reader(k))
             for k in keys]
    written = write_safetensors(items, out, max_shard_bytes=max_shard_bytes, progress=progress)
    for p in (ckpt / "hf").iterdir():
        if p.name != "params.json":
            shutil.copy(p, out / p.name)
    write_generation_config(out)  # a checkpoint written before the trainer saved one has none
    return written


def _export_adapter(ckpt: Path, out: Path, keys: list[str], metadata: dict, shapes: dict) -> Path:
    """LoRA checkpoint -> PEFT adapter folder (adapters are small: one file)."""
    if not (ckpt / "hf" / "adapter_config.json").is_file():
        raise UserError(f"export: '{ckpt}' says lora=true but has no hf/adapter_config.json: it was written by an "
                        "older shardtune; re-save it with this version")
    tensors = _adapter_tensors(ckpt, keys, metadata, shapes)
    from peft import LoraConfig  # only LoRA checkpoints need peft

    save_adapter(tensors, LoraConfig.from_pretrained(str(ckpt / "hf")), out)
    for p in (ckpt / "hf").iterdir():
        if p.name not in ("params.json", "adapter_config.json", "config.json"):
            shutil.copy(p, out / p.name)  # the tokenizer
    return out / ADAPTER_WEIGHTS


def _adapter_tensors(ckpt: Path, keys: list[str], metadata: dict, shapes: dict) -> dict[str, torch.Tensor]:
    tensors = {k.removeprefix("replicated."): _read_tensor(ckpt, k, metadata[k]) for k in keys}
    return {n: t.view(shapes[n]["shape"]) for n, t in tensors.items()}


def adapter_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """{our parameter name: full tensor} of a LoRA checkpoint's adapters (small: read whole)."""
    shapes = json.loads((ckpt / "hf" / "params.json").read_text())
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith("replicated.") and k[len("replicated."):] in shapes]
    return _adapter_tensors(ckpt, keys, metadata, shapes)

