"""`shardtune export CHECKPOINT OUT`: a sharded checkpoint -> HF safetensors (+ index), streamed tensor by tensor.

Each tensor is read alone from the DCP files (no process group, any world size) and appended to the current
output file; a file is written once it reaches `max_shard_bytes`. Peak memory: about one output file, never the
whole model.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtune.checkpoint.paths import TRAINER_FILE, require_complete
from shardtune.errors import UserError
from shardtune.lora import ADAPTER_WEIGHTS, save_adapter


def _read_tensor(ckpt: Path, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    t = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load({key: t}, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return t


def export_checkpoint(ckpt: Path, out: Path, *, max_shard_bytes: int = 2 * 1024**3,
                      progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """`progress(done_bytes, total_bytes, file_name)` after each tensor is read and after each file is written."""
    if (ckpt / "latest").is_file():  # a checkpoints/ folder: take its newest
        ckpt = ckpt / (ckpt / "latest").read_text().strip()
    require_complete(ckpt, "export", "point it at <output_dir>/checkpoints/step_N")
    info = json.loads((ckpt / TRAINER_FILE).read_text())
    shapes = json.loads((ckpt / "hf" / "params.json").read_text())
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    prefix = "replicated." if info.get("lora") else "model."
    keys = [k for k in metadata if k.startswith(prefix) and k[len(prefix):] in shapes]
    if not keys:
        raise UserError(f"export: no model tensors in '{ckpt}'")
    if info.get("lora"):
        return [_export_adapter(ckpt, out, keys, metadata, shapes)]
    out.mkdir(parents=True, exist_ok=True)

    # Plan the files first (sizes are in the metadata), so names can say "-of-N" while streaming.
    files: list[list[str]] = [[]]
    size = 0
    total = 0
    for k in keys:
        m = metadata[k]
        n = m.size.numel() * m.properties.dtype.itemsize
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(k)
        size += n
        total += n
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    weight_map = {}
    written = []
    done = 0
    for fname, group in zip(names, files):
        tensors = {}
        for k in group:
            name = k[len(prefix):]
            tensors[name] = _read_tensor(ckpt, k, metadata[k]).view(shapes[name]["shape"])
            weight_map[name] = fname
            done += tensors[name].numel() * tensors[name].element_size()
            if progress is not None:
                progress(done, total, "")
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        written.append(out / fname)
        if progress is not None:
            progress(done, total, fname)
        del tensors  # only one output file is ever held
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for p in (ckpt / "hf").iterdir():
        if p.name != "params.json":
            shutil.copy(p, out / p.name)
    return written


def _export_adapter(ckpt: Path, out: Path, keys: list[str], metadata: dict, shapes: dict) -> Path:
    """LoRA checkpoint -> PEFT adapter folder (adapters are small: one file)."""
    if not (ckpt / "hf" / "adapter_config.json").is_file():
        raise UserError(f"export: '{ckpt}' says lora=true but has no hf/adapter_config.json: it was written by an "
                        "older shardtune; re-save it with this version")
    tensors = {k.removeprefix("replicated."): _read_tensor(ckpt, k, metadata[k]) for k in keys}
    tensors = {n: t.view(shapes[n]["shape"]) for n, t in tensors.items()}
    from peft import LoraConfig  # only LoRA checkpoints need peft

    save_adapter(tensors, LoraConfig.from_pretrained(str(ckpt / "hf")), out)
    for p in (ckpt / "hf").iterdir():
        if p.name not in ("params.json", "adapter_config.json", "config.json"):
            shutil.copy(p, out / p.name)  # the tokenizer
    return out / ADAPTER_WEIGHTS
