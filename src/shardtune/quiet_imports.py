"""Silence known, harmless import-time log records of optional dependencies (targeted, not a global level change).

torchao (installed for the NF4 base, and imported by peft whenever it is installed) logs one warning per optional
CUDA/CUTLASS kernel library it cannot load, which is always on a CPU build, and torch logs a deprecation for each
Enum torchao registers as a pytree constant. Neither concerns NF4. The filter drops exactly those records; it must
be installed before peft or torchao is imported, so `shardtune/__init__.py` installs it.
"""
from __future__ import annotations

import logging

_SO = "Failed to load "  # torchao/__init__.py: f"Failed to load {file}: {e}" for optional `_C*.so` kernels
_ENUM = "is an Enum subclass and is now natively supported"  # torch/utils/_pytree.py: register_constant(Enum)


class _DropImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith(_SO) and ".so" in msg) and _ENUM not in msg


def install() -> None:
    """Idempotent."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) for f in logger.filters):
            logger.addFilter(_DropImportNoise())
