"""PyTorch `.bin` checkpoints (`pytorch_model.bin`, or shards with `pytorch_model.bin.index.json`), read through
the same calls as a safetensors file (`keys`, `get_slice`, `get_tensor`), so the sharded loader, the shape check
and `export --merge` read both formats alike.

Many fine-tunes on the hub and on users' disks predate safetensors. `torch.load(mmap=True, weights_only=True)` maps
the file instead of reading it: a rank pages in only the rows of its pieces, as with safetensors, and no pickled
code runs. A file in torch's pre-1.6 (non-zip) format cannot be mapped; it gets one line saying how to re-save it.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from shardtune.errors import UserError
from shardtune.hub import BIN_WEIGHTS

PATTERN, INDEX = BIN_WEIGHTS  # pytorch_model*.bin: not training_args.bin and the like, saved beside the weights

# safetensors' dtype names (what merge and the rank check read from get_dtype)
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class _Slice:
    """A tensor as safetensors' slice object: shape and dtype without reading, rows on indexing (a copy)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def get_shape(self) -> list[int]:
        return list(self._t.shape)

    def get_dtype(self) -> str:
        return _DTYPE_NAMES.get(self._t.dtype, str(self._t.dtype))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._t[index].clone()  # a fresh tensor, as safetensors gives: nothing writes into the mapping


class BinFile:
    """One `.bin` file, memory-mapped; its tensors are views of the mapping until read."""

    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"model.path: '{path}' cannot be read as PyTorch weights ({first[:200]}): re-save it "
                            "with a current torch (`torch.save(torch.load(f), f)`) or as safetensors "
                            "(`save_pretrained`)") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise UserError(f"model.path: '{path}' is not a state dict of tensors: point model.path at the "
                            "model's weights")
        self._state: dict[str, torch.Tensor] = state

    def __enter__(self) -> BinFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._state = {}  # drops the views, and with them the mapping

    def keys(self) -> list[str]:
        return list(self._state)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._state[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._state[key].clone()


def bin_files(folder: Path) -> list[Path]:
    """The folder's `.bin` weight files, sorted (empty when it has none)."""
    return sorted(folder.glob(PATTERN))
