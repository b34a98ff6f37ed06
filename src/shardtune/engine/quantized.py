"""A unit's NF4-quantized frozen weights (QLoRA base) as one flat byte buffer, sharded like any flat buffer.

Layout (bytes; each weight's region as in nf4_layout.py, a whole number of 32-byte code blocks):

    [ weight 0: codes | scalers | factors | mean | weight 1: ... | padding ]     padded to a multiple of 32·W

so rank r owns bytes [r·P/W, (r+1)·P/W) and a shard boundary never falls inside a quantization block. The bytes
do not depend on W (each weight is quantized whole, before sharding; only the trailing padding changes): every
world size computes with the same quantized weights. The unit's all-gather moves these bytes (uint8): ~0.52 bytes
per weight instead of 2 for a bf16 base.

After the gather, each frozen Linear's `weight` attribute is an `NF4Tensor` over views of the gathered buffer
(`bind_views`); `F.linear` dequantizes it per matmul (torchao's linear_nf4). The views alias `full`, so the
NF4Tensors autograd saved for backward read the re-gathered bytes, exactly like `FlatParam`'s frozen views.

It duck-types the part of `FlatParam` that `Unit` and `shard_model` use (a frozen flat: no gradient, no segments).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardtune import accelerator
from shardtune.engine.flat_param import GatheredBuffer, slot_pieces
from shardtune.engine.layout import Entry, padded
from shardtune.engine.nf4_layout import BLOCK_BYTES, Nf4Layout

Reader = Callable[[int, int], torch.Tensor]  # (start, length) -> that flat range of a weight


class Nf4Slot:
    def __init__(self, name: str, layout: Nf4Layout, offset: int, locations: list[tuple[nn.Module, str]]) -> None:
        self.name = name  # canonical parameter name
        self.layout = layout
        self.offset = offset  # first byte of the weight's region in the flat buffer
        self.numel = layout.nbytes  # bytes of the region (a "numel" of the uint8 buffer)
        self.shape = layout.shape  # the weight's logical shape
        self.locations = locations  # every (module, attr) holding it


class QuantizedFlat(GatheredBuffer):
    requires_grad = False
    segments: list = []  # no trainable segment: nothing for the optimizer
    local = False  # gathered like any unit flat (only vocabulary tables stay local: engine/vocab.py)
    register_name = "_shardtune_flat_nf4"  # name of the shard on the unit module (shard.py)

    def __init__(self, params: list[Entry], *, nf4_dtype: torch.dtype, shard_rank: int, shard_size: int,
                 device: torch.device, offload: bool = False, tile_bytes: int = 0) -> None:
        """`params`: frozen 2-D weights in buffer order. `nf4_dtype`: what they dequantize to (the compute dtype).
        `tile_bytes` > 0: the matmuls dequantize row tiles of that size (engine/nf4_linear.py), not whole weights.
        Real (non-meta) weights are quantized now, each whole, keeping this rank's bytes; meta ones are filled by
        `fill` (the sharded loader)."""
        self.dtype = torch.uint8  # of the shard and of the gathered buffer
        self.compute_dtype = torch.uint8  # the gather moves bytes; the matmul dequantizes to nf4_dtype
        self.nf4_dtype = nf4_dtype
        self.tile_bytes = tile_bytes
        self.slots: list[Nf4Slot] = []
        offset = 0
        for name, p, locs in params:
            # experts stored [E, in, out] (gpt-oss) say so (transformers' `is_transposed`): their blocks run along
            # the input dim too, as a Linear's do
            transposed = any(getattr(m, "is_transposed", False) for m, _ in locs)
            layout = Nf4Layout.of(p.shape, nf4_dtype, transposed=transposed)
            self.slots.append(Nf4Slot(name, layout, offset, list(locs)))
            offset += layout.nbytes
        self.numel = offset  # unpadded bytes
        self.padded_numel = padded(offset, shard_size * BLOCK_BYTES)  # P: whole code blocks per rank
        self.shard_numel = self.padded_numel // shard_size  # P / W
        self.shard_size = shard_size
        self.shard_rank = shard_rank
        self.device = device
        # 1D, uint8, P/W bytes: this rank's codes + scales (offload: on the host, pinned at its exact size on CUDA)
        self.shard = (accelerator.host_resident(self.shard_numel, torch.uint8, device, zero=True) if offload
                      else torch.zeros(self.shard_numel, dtype=torch.uint8, device=device))
        self.label = ""
        # No shard group, on the device: the shard IS the gathered buffer (as FlatParam's no_shard fp32): the bytes
        # are never copied, so a unit of one rank holds its base once, not twice (no_shard keeps every unit gathered).
        self.aliased = shard_size == 1 and not offload
        self.full = self.shard if self.aliased else torch.empty(0, dtype=torch.uint8, device=device)  # 1D, uint8
        real = {name: p for name, p, _ in params if not p.is_meta}
        if real:
            self.fill(lambda name: (lambda a, m: real[name].detach().reshape(-1)[a:a + m]), only=set(real))

    def pieces(self, shard_rank: int | None = None) -> Iterator[tuple[int, int, int, int]]:
        """(slot index, start in the weight's region, start in the shard, length) of each byte range a rank holds."""
        return slot_pieces(self.slots, self.shard_rank if shard_rank is None else shard_rank, self.shard_numel)

    def fill(self, reader: Callable[[str], Reader], *, only: set[str] | None = None) -> None:
        """Quantize every weight with bytes in this rank's shard and keep those bytes (written straight into the
        shard). A weight is read through `reader(name)` in chunks: one chunk's temporaries at a time."""
        from shardtune.engine import nf4  # torchao: imported only when a base is quantized

        for i, start, s_start, n in self.pieces():
            slot = self.slots[i]
            if only is not None and slot.name not in only:
                continue

            def write(off: int, data: torch.Tensor, start=start, s_start=s_start, n=n) -> None:
                """Keep the part of [off, off + len) that falls in this rank's piece [start, start + n)."""
                a, b = max(off, start), min(off + data.numel(), start + n)
                if a < b:
                    self.shard[s_start + a - start:s_start + b - start].copy_(data[a - off:b - off])

            nf4.quantize_into(write, reader(slot.name), slot.layout, self.shard.device)

    # -- unsharded buffer (alloc_full, free_full: GatheredBuffer) -------------------------------------------------
    def gather_input(self) -> torch.Tensor:
        return self.shard_on_device(torch.uint8)  # offload: H2D of the bytes; else no copy

    def wait_host_reads(self) -> None:
        """Nothing to wait for: the frozen base's host shard is only read (no optimizer writes it). Its copies'
        events are recorded all the same (GatheredBuffer), and never waited on."""

    def bind_views(self, *, requires_grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Point each Linear's weight at an NF4Tensor over the gathered bytes. The base never takes a gradient."""
        from shardtune.engine import nf4, nf4_linear

        assert not requires_grad, "a quantized base is frozen"
        src = self.full.data  # own version counter: re-gathering for backward does not trip autograd's checks
        views = []
        for s in self.slots:
            region = src[s.offset:s.offset + s.numel]
            w = (nf4_linear.tiled_view(region, s.layout, self.tile_bytes) if self.tile_bytes
                 else nf4.nf4_view(region, s.layout))
            if len(s.shape) == 3:  # fused experts: their grouped forward dequantizes runs of experts
                from shardtune.engine.nf4_experts import Nf4Experts

                w = Nf4Experts(w, s.layout.quantized_shape, tile_bytes=self.tile_bytes)
            views.append(w)
            for module, attr in s.locations:
                module.__dict__[attr] = w
        return src, views

    def dequantized(self, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, weight in nf4_dtype) from a gathered buffer: what the matmuls compute with."""
        from shardtune.engine import nf4

        for s in self.slots:
            yield s.name, nf4.dequantize(full[s.offset:s.offset + s.numel], s.layout)

    # -- no gradient -----------------------------------------------------------------------------------------------
    def shard_grad(self) -> None:
        return None

    def state_bytes(self) -> int:
        return self.shard.nbytes
