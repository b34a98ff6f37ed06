"""Sharded loading of a pretrained HF checkpoint (`model.init=pretrained`): no rank ever holds the whole model.

1. `build_empty`: the model is built with its parameters on the meta device (no bytes) and its buffers real
   (accelerate's `init_empty_weights(include_buffers=False)`), so non-persistent buffers such as rotary `inv_freq`
   are computed by the model's own constructor, as `from_pretrained` would.
2. The engine shards it (flat shards allocated, zero-filled: meta parameters are skipped).
3. `load_into_shards`: each rank opens the safetensors files (mmap, `safe_open`; or `.bin` files, mapped by
   model/bin_weights.py) and reads only the pieces of each parameter its shard holds. A piece is a flat range of a parameter; it is read as the few whole rows that cover it
   (`get_slice`), so a rank holds at most its shards + one tensor's rows at any time.
Persistent buffers found in the checkpoint are loaded whole (they are small and not sharded).
"""
from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn

from shardtune.errors import UserError
from shardtune.model import bin_weights
from shardtune.model.fingerprint import Hasher, check_same_on_all_ranks

INDEX = "model.safetensors.index.json"


def build_empty(build: Any) -> nn.Module:
    """Call `build()` (e.g. `AutoModelForCausalLM.from_config`) with parameters on meta, buffers real."""
    with init_empty_weights(include_buffers=False):
        model = build()
    # accelerate wraps every parameter anew as it is registered, so transformers' tie (the head's weight set to the
    # embedding's Parameter) left two Parameters: a tied model (Llama-3.2-1B, Qwen2.5 up to 3B, Gemma) would train
    # an independent head, and its checkpoints, which hold no lm_head.weight, would not load. Tied again here.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def checkpoint_key(name: str) -> str:
    """Our parameter name -> the checkpoint's: peft's LoRA layers hold the original weight as `base_layer`."""
    return name.replace(".base_layer.", ".")


def weight_files(path: Path) -> list[Path]:
    """The folder's weight files: its *.safetensors, else its PyTorch .bin files (model/bin_weights.py)."""
    return sorted(path.glob("*.safetensors")) or bin_weights.bin_files(path)


def no_weights(path: Path | str) -> str:
    return (f"model.path: no *.safetensors (or pytorch_model*.bin) in '{path}': point it at the folder of an HF "
            "checkpoint (config.json beside its weights)")


def weight_map(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the file holding it (an index file, or every weight file in the folder)."""
    for index in (INDEX, bin_weights.INDEX):
        if (path / index).is_file():
            return {k: path / f for k, f in json.loads((path / index).read_text())["weight_map"].items()}
    files = weight_files(path)
    if not files:
        raise UserError(no_weights(path))
    out = {}
    for f in files:
        with _open(f) as h:
            out.update({k: f for k in h.keys()})  # noqa: SIM118 (safe_open handles are not dicts)
    return out


def _open(f: Path) -> Any:
    """A file's handle (a context manager): safetensors' own, or the same calls over a mapped .bin."""
    return bin_weights.BinFile(f) if f.suffix == ".bin" else safe_open(str(f), framework="pt", device="cpu")


def read_flat_range(handle: Any, key: str, start: int, length: int) -> torch.Tensor:
    """Elements [start, start+length) of the flattened tensor `key`, reading only the rows that cover them."""
    sl = handle.get_slice(key)
    shape = sl.get_shape()
    if len(shape) <= 1:
        return sl[start:start + length] if shape else sl[:].reshape(1)
    row = math.prod(shape[1:])
    r0, r1 = start // row, -(-(start + length) // row)
    return sl[r0:r1].reshape(-1)[start - r0 * row:start - r0 * row + length]


class CheckpointFiles:
    """Open weight files (mmap) by key, each once; a context manager closes them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = weight_map(path)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def handle(self, key: str) -> Any:
        if key not in self.files:
            raise UserError(f"model.path: '{self.path}' lacks weight {key}: is it a checkpoint of this architecture?")
        f = self.files[key]
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(_open(f))
        return self._handles[f]

    def load_buffers(self, module: nn.Module) -> None:
        """Persistent buffers the checkpoint has (small, unsharded) are loaded whole; the others keep the values
        the model's constructor computed."""
        for name, buf in module.named_buffers():
            key = checkpoint_key(name)
            if key in self.files:
                buf.copy_(self.handle(key).get_tensor(key))


def check_checkpoint_shapes(model: nn.Module, path: Path, config_source: str) -> None:
    """Each weight the checkpoint holds for `model` (built on meta from `config_source`) has the model's shape: a
    config of another size of the architecture beside these weights is one line, not a copy error in every rank's
    loader. Reads the files' headers only; weights the checkpoint lacks are the loaders' to report."""
    with CheckpointFiles(path) as ckpt:
        for name, p in model.named_parameters():
            key = checkpoint_key(name)
            if key in ckpt.files:
                shape = list(ckpt.handle(key).get_slice(key).get_shape())
                if shape != list(p.shape):
                    raise UserError(f"model.path: '{ckpt.files[key]}' holds {key} as {shape} but {config_source} "
                                    f"makes it {list(p.shape)}: that config describes another model (another size "
                                    "of the architecture?); use the config saved with these weights")


def load_into_shards(flats: list[Any], module: nn.Module, path: Path) -> None:
    """Fill each flat buffer's shard (`engine.flat_param.FlatParam`) with this rank's pieces of the checkpoint."""
    with CheckpointFiles(path) as ckpt:
        missing = sorted({checkpoint_key(s.name) for f in flats for s in f.slots} - set(ckpt.files))
        if missing:
            raise UserError(f"model.path: '{path}' lacks {len(missing)} weight(s) the model needs, e.g. "
                            f"{missing[:3]}: is it a checkpoint of this architecture?")
        for flat in flats:
            if hasattr(flat, "fill"):  # NF4 base (engine/quantized.py): each weight read in chunks and quantized
                flat.fill(lambda name: _range_reader(ckpt, checkpoint_key(name)))
                continue
            for i, p_start, s_start, n in flat.pieces():
                key = checkpoint_key(flat.slots[i].name)
                piece = read_flat_range(ckpt.handle(key), key, p_start, n)
                flat.shard[s_start:s_start + n].copy_(piece)  # casts to the shard's dtype
                del piece
        ckpt.load_buffers(module)
        _check_same_files(ckpt, sorted({checkpoint_key(s.name) for f in flats for s in f.slots}),
                          flats[0].device if flats else torch.device("cpu"))


def _check_same_files(ckpt: CheckpointFiles, keys: list[str], device: torch.device) -> None:
    """Each rank read different pieces, so the pieces cannot be compared; a sample can: the shape and dtype of every
    weight and the values of the 1-D ones (norms, biases: small, and a fine-tune changes them). Equal on every rank
    when every node points model.path at the same checkpoint; another checkpoint of the same architecture (a base vs
    an instruct model on one node) is caught; checkpoints that differ only in matrices are not (reading a row of
    each would hold a whole tensor's storage per row: safetensors slices are views of it). Cost: a read of the 1-D
    weights, one at a time; one all-gather."""
    h = Hasher()
    for k in keys:
        sl = ckpt.handle(k).get_slice(k)
        shape = sl.get_shape()
        h.note(f"{k}:{shape}:{sl.get_dtype()}")
        if len(shape) <= 1:
            h.update(sl[:])
    check_same_on_all_ranks([(f"model.path '{ckpt.path}' (shapes and 1-D weights)", h.value())], device)


def _range_reader(ckpt: CheckpointFiles, key: str) -> Any:
    handle = ckpt.handle(key)
    return lambda start, length: read_flat_range(handle, key, start, length)
