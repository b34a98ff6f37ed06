"""A dispatch mode that sums the bytes of every tensor the ops create: what a pass writes, not its peak."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class BytesCreated(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor))
        return out
