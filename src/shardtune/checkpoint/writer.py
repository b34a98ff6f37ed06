"""Stream tensors into HF safetensors files: one output file in memory at a time, an index when there are several.

Both exports use it: `export` (tensors read from a sharded checkpoint) and `export --merge` (base weights with
their adapters merged in). Each item is (name, bytes, read): the files are planned from the sizes first, so names can
say "-of-N" while streaming, and `read()` loads one tensor only when its file is being built.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

Item = tuple[str, int, Callable[[], torch.Tensor]]


def write_safetensors(items: list[Item], out: Path, *, max_shard_bytes: int,
                      progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """`progress(done_bytes, total_bytes, file_name)` after each tensor is read and after each file is written."""
    out.mkdir(parents=True, exist_ok=True)
    groups: list[list[Item]] = [[]]
    size = total = 0
    for item in items:
        if groups[-1] and size + item[1] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1]
        total += item[1]
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map: dict[str, str] = {}
    written = []
    done = 0
    for fname, group in zip(names, groups):
        tensors = {}
        for name, nbytes, read in group:
            tensors[name] = read().contiguous()
            weight_map[name] = fname
            done += nbytes
            if progress is not None:
                progress(done, total, "")
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        written.append(out / fname)
        if progress is not None:
            progress(done, total, fname)
        del tensors  # only one output file is ever held
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return written
