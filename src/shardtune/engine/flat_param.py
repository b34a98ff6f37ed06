"""One unit's parameters as one flat, padded buffer, sharded over the shard group (FSDP1-style "flat param").

Layout of a trainable buffer (numel T, padded to P = ceil(T / W)·W for W ranks in the shard group):

    [ decay params ... | no-decay params ... | padding ]      rank r owns [r·P/W, (r+1)·P/W)

so each rank's shard holds at most two contiguous segments (decay, no-decay). Each segment is an `nn.Parameter`
sharing storage with the shard, and its `.grad` is a view of the sharded gradient: torch AdamW with two groups over
the segments is exactly single-device AdamW (weight decay and moments are elementwise).

While the unit is unsharded, the original parameters are replaced on their modules by views of one gathered buffer
(`full`, numel P, compute dtype). In a grad-enabled forward those views come from a fresh autograd leaf aliasing
`full`; autograd sums their gradients into one flat gradient of numel P (a single cat in SplitBackward), which is
what the reduce-scatter needs: no per-parameter copy-in.

Frozen parameters go into a separate FlatParam with `requires_grad=False`: no gradient, no optimizer state, no
reduce-scatter, and the shard stays in the parameters' own dtype (e.g. a bf16 base under LoRA).
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardtune import accelerator, memory
from shardtune.engine.layout import padded


@dataclass
class ParamSlot:
    name: str  # canonical name, as in the original module's named_parameters()
    shape: torch.Size
    offset: int  # first element in the flat buffer
    numel: int
    locations: list[tuple[nn.Module, str]] = field(default_factory=list)  # every (module, attr) holding it (tied)


class GatheredBuffer:
    """The unsharded buffer `full` (padded_numel elements) of a unit flat, freed and re-grown in place around each
    use, and the shard's copies to the device; shared by FlatParam and the NF4 QuantizedFlat. `aliased`: `full` is
    the shard itself (one rank)."""
    full: torch.Tensor
    padded_numel: int
    aliased: bool
    shard: torch.Tensor  # 1D, numel P/W; offloaded: on the host, pinned on an accelerator
    device: torch.device  # the compute device: `full` lives here
    label: str  # the unit it belongs to, for the simulated GPU's record
    # offload on an accelerator: the event after the last H2D copy of the shard (None: none since the last wait)
    _h2d_done: Any = None

    def is_full_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def alloc_full(self) -> None:
        """Re-grow `full`'s storage. Views created earlier (saved by autograd) alias it and see the new data."""
        if not self.aliased and not self.is_full_allocated():
            storage = self.full.untyped_storage()
            storage.resize_(self.padded_numel * self.full.element_size())
            if self.full.numel() != self.padded_numel:  # first allocation: same tensor object, now of numel P
                self.full.set_(storage, 0, (self.padded_numel,), (1,))
            memory.storage_resized(self.full)

    def free_full(self) -> None:
        """Free the gathered storage but keep the tensor object: autograd's saved views of it stay valid handles."""
        if not self.aliased and self.is_full_allocated():
            memory.free_storage(self.full)

    def shard_on_device(self, dtype: torch.dtype) -> torch.Tensor:
        """The shard on the compute device in `dtype`: offloaded, an H2D copy on the current stream (`_copy_shard`);
        then the cast, none when already so."""
        send = self._copy_shard()
        if send.dtype != dtype:
            accelerator.note(self.device, "cast", self.label)
        return send.to(dtype)

    def _copy_shard(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The shard on the compute device (into `out` when given): offloaded on an accelerator, a non-blocking H2D
        copy from pinned memory on the current stream; otherwise the shard itself. The copy reads the host shard
        when the stream gets there: the host optimizer must not write the shard before (FlatParam's
        `wait_host_reads` blocks on the last copy's event, which covers the earlier ones)."""
        send, done = accelerator.copy_to_device(self.shard, self.device, out=out, label=self.label)
        if done is not None:
            self._h2d_done = done
        return send


class FlatParam(GatheredBuffer):
    def __init__(self, params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]], *,
                 requires_grad: bool, num_decay: int, shard_rank: int, shard_size: int,
                 compute_dtype: torch.dtype, device: torch.device, offload: bool = False,
                 pad_multiple: int | None = None) -> None:
        """`params` in buffer order; the first `num_decay` of them get weight decay (trainable buffers only).
        `pad_multiple`: pad T to a multiple of this (itself a multiple of W) instead of W: a vocabulary table
        padded to W·H gives each rank whole rows (engine/vocab.py).
        `offload`: the shard (and so its gradient and AdamW state) lives on the host, pinned when `device` is CUDA;
        only the gathered buffer lives on `device`."""
        dtypes = {p.dtype for _, p, _ in params}
        assert len(dtypes) == 1, f"one dtype per flat buffer, got {dtypes}"  # checked with a UserError in layout.py
        self.dtype: torch.dtype = dtypes.pop()  # master dtype of the shard (fp32 for trainable weights)
        self.compute_dtype = compute_dtype  # dtype of the gathered buffer and of forward/backward compute
        self.requires_grad = requires_grad
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, p, locs in params:
            self.slots.append(ParamSlot(name, p.shape, offset, p.numel(), list(locs)))
            offset += p.numel()
        self.numel = offset  # unpadded T
        assert pad_multiple is None or pad_multiple % shard_size == 0
        self.padded_numel = padded(offset, pad_multiple or shard_size)  # P, a multiple of W
        self.shard_numel = self.padded_numel // shard_size  # P / W
        self.shard_size = shard_size
        self.shard_rank = shard_rank
        lo, hi = shard_rank * self.shard_numel, (shard_rank + 1) * self.shard_numel

        # The shard: 1D, master dtype, numel P/W. Built from the full parameters every rank holds at construction
        # (same seed); costs one unit of extra host memory transiently. Meta params (loader fills later) are skipped.
        self.device = device  # compute device: `full` lives here
        # The shard lives on the host, apart from the compute device (told by the flag, not by `.device`: the
        # simulated host's buffers are meta tensors, plan/simulate.py).
        self.on_host = offload and accelerator.is_accelerator(device)
        if offload:  # pinned (CUDA: at its exact size) so that the H2D copy before each all-gather runs async
            self.shard = accelerator.host_resident(self.shard_numel, self.dtype, device, zero=True)
        else:
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
        for slot, (_, p, _) in zip(self.slots, params, strict=True):
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if a < b and not p.is_meta:
                self.shard[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - slot.offset:b - slot.offset])

        # Segments this rank owns, in shard-local coordinates: decay [0, D) and no-decay [D, T) intersected.
        d = sum(s.numel for s in self.slots[:num_decay])
        self.segments: list[tuple[bool, int, int, nn.Parameter]] = []  # (decay?, start, end, param view)
        if requires_grad:
            for decay, (a, b) in ((True, (0, d)), (False, (d, self.numel))):
                a, b = max(a, lo) - lo, min(b, hi) - lo
                if a < b:
                    self.segments.append((decay, a, b, nn.Parameter(self.shard[a:b])))
        self._shard_grad_ref: weakref.ref[torch.Tensor] | None = None  # weak: zero_grad(set_to_none) frees it
        self.label = ""  # the unit it belongs to, for the simulated GPU's record (shard.py sets it)
        # Never gathered: a vocabulary table used row-sharded where it is (engine/vocab.py); its gradient reaches
        # the segments through autograd, already summed over the shard group.
        self.local = False
        # cpu_offload, a local table: its rows (1D, master dtype, numel P/W) on the device while its unit is
        # unsharded, copied on the unit's copy stream ahead of use (unit.py); None otherwise (vocab.py copies then).
        self.staged: torch.Tensor | None = None

        # No shard group and no cast: the shard IS the full buffer (no_shard fp32); never freed, nothing copied.
        # (Offloaded: never, told by the flag; a simulated host shard is a meta tensor, as the simulated device is.)
        self.aliased = shard_size == 1 and compute_dtype == self.dtype and not self.on_host
        if self.aliased:
            self.full = self.shard
        else:
            # 1D, compute dtype, numel P once allocated. Created empty: never allocated here, so building a model
            # (e.g. while loading a checkpoint) holds no gathered unit, not even transiently.
            self.full = torch.empty(0, dtype=compute_dtype, device=device)

    def pieces(self, shard_rank: int | None = None) -> Iterator[tuple[int, int, int, int]]:
        """(slot index, start in the parameter, start in the shard, length) of each piece a shard rank holds."""
        return slot_pieces(self.slots, self.shard_rank if shard_rank is None else shard_rank, self.shard_numel)

    # -- unsharded buffer ------------------------------------------------------------------------------------------
    def gather_input(self) -> torch.Tensor:
        """What this rank sends in the all-gather: its shard on the compute device (offload: the H2D copy, a no-op
        on CPU), cast to the compute dtype (halves bytes for bf16). Issued on the current stream: the unit puts
        offload's copies on its copy stream (unit.py)."""
        return self.shard_on_device(self.compute_dtype)

    def stage_rows(self) -> bool:
        """cpu_offload, a local table: room for its rows on the device, allocated on the current (compute) stream,
        as `full` is. True when there is a copy to issue (`copy_rows`)."""
        if not (self.local and self.on_host and self.staged is None):
            return False
        self.staged = torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
        return True

    def copy_rows(self) -> None:
        """The rows' H2D copy into `staged`, non-blocking from pinned memory, on the current (copy) stream."""
        assert self.staged is not None
        self._copy_shard(out=self.staged)

    def unstage_rows(self) -> None:
        self.staged = None  # autograd may still hold views of it for backward: they keep it alive

    def wait_host_reads(self) -> None:
        """Offload: block until the device has finished copying the host shard (before the optimizer writes it)."""
        accelerator.host_wait(self._h2d_done)
        self._h2d_done = None

    def bind_views(self, *, requires_grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Point every original parameter attribute at its view of `full`. Returns the tensor the views come from
        and the views: with grad, a fresh leaf aliasing `full` (own version counter, so refilling `full` later for
        backward does not trip autograd's in-place checks); its .grad will be the flat gradient (1D, compute
        dtype, numel P)."""
        if requires_grad:
            src = self.full.data.requires_grad_(True)
            pad = self.padded_numel - self.numel
            pieces = src.split([s.numel for s in self.slots] + [pad])
        else:
            src = self.full.data  # own version counter too: frozen views are saved by autograd (LoRA base)
            pieces = [src[s.offset:s.offset + s.numel] for s in self.slots]
        views = []
        for slot, piece in zip(self.slots, pieces, strict=False):
            view = piece.view(slot.shape)
            views.append(view)
            for module, attr in slot.locations:
                module.__dict__[attr] = view  # plain attribute: the nn.Parameter was removed at shard time
        return src, views

    # -- sharded gradient ------------------------------------------------------------------------------------------
    def shard_grad(self) -> torch.Tensor | None:
        """The sharded gradient (1D, fp32, numel P/W) if one is live, i.e. the optimizer did not drop it."""
        if self.local:  # autograd accumulates a row-sharded table's gradient into its segment directly
            return self.segments[0][3].grad if self.segments else None
        base = self._shard_grad_ref() if self._shard_grad_ref is not None else None
        if base is None or any(seg.grad is None for _, _, _, seg in self.segments):
            return None
        return base

    def accumulate_shard_grad(self, new: torch.Tensor) -> None:
        """shard grad += new (1D, numel P/W); `new` is owned by us and becomes the grad when there is none."""
        if not self.segments:
            return  # this rank owns only padding
        new = new.to(self.shard.device, self.dtype)  # offload: the reducer already copied it to the host
        base = self.shard_grad()
        if base is None:
            base = new
            self._shard_grad_ref = weakref.ref(base)
            for _, a, b, seg in self.segments:
                seg.grad = base[a:b]  # views: keep `base` alive exactly as long as the optimizer keeps grads
        else:
            base.add_(new)

    def state_bytes(self) -> int:
        """Bytes of this rank's model states held here: the shard plus its gradient when live."""
        g = self.shard_grad()
        return self.shard.nbytes + (g.nbytes if g is not None else 0)


def slot_pieces(slots: list, shard_rank: int, shard_numel: int) -> Iterator[tuple[int, int, int, int]]:
    """(slot index, start in the slot, start in the shard, length) of each range of a flat buffer laid out as
    `slots` (each with .offset, .numel) that shard `shard_rank` of `shard_numel` elements holds."""
    lo, hi = shard_rank * shard_numel, (shard_rank + 1) * shard_numel
    for i, s in enumerate(slots):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a < b:
            yield i, a - s.offset, a - lo, b - a
