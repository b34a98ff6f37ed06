"""Activation checkpointing of whole units (non-reentrant `torch.utils.checkpoint`), applied before sharding.

The unit's `forward` is replaced on the instance by a checkpointed call of the original, so the module tree and
parameter names do not change (no wrapper module) and the engine's hooks, registered on the module's `__call__`,
stay *outside* the checkpointed region: the forward pre-hook gathers the unit once, the output hook gathers it again
for backward, and the recompute (triggered inside the unit's backward, after that hook) runs on that same gathered
buffer: no extra all-gather and no hook inside recompute that could free it. Cost: one more forward of each
checkpointed unit; saving: all the unit's activations but its inputs.
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import find_units


def apply_activation_checkpointing(model: nn.Module, unit_classes: tuple[type[nn.Module], ...], *,
                                   every_k: int = 1, min_unit_params: int | None = None,
                                   offloader: ActivationOffloader | None = None) -> list[nn.Module]:
    """Checkpoint every `every_k`-th unit (units 0, k, 2k, ... in forward order); returns those modules.
    `offloader`: their kept inputs live on the host between forward and recompute (offload_activations.py)."""
    assert every_k >= 1
    chosen = find_units(model, unit_classes, min_unit_params)[::every_k]
    for unit in chosen:
        if offloader is not None:
            unit.forward = offloader.checkpointed(unit.forward)
        else:
            unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)
    return chosen
