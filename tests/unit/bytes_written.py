"""A dispatch mode that sums the bytes of every tensor the ops create: what a pass writes, not its peak. An output
on an input's storage (a view, a detach, an in-place op) writes no new tensor and is not counted."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class BytesCreated(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {_storage(t) for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.bytes += sum(t.numel() * t.element_size() for t in leaves(out)
                          if isinstance(t, torch.Tensor) and _storage(t) not in inputs)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
