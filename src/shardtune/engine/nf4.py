"""NF4 (QLoRA's 4-bit NormalFloat) through torchao's `NF4Tensor`: quantize a weight into its byte layout
(nf4_layout.py), rebuild an `NF4Tensor` over views of a byte buffer. The only module that imports torchao.

Why torchao rather than bitsandbytes: torchao's NF4 is pure PyTorch (runs forward and backward on CPU and CUDA, so
the gloo parity tests exercise the real code path), its parts are plain tensors we can lay into our own flat
buffers and rebuild views over (bitsandbytes keeps them in a `Params4bit` + `QuantState` and dequantizes with
CUDA kernels), and it ships FSDP2 all-gather hooks for `engine.backend=torch`.

Quantization is per whole tensor (the mean and the scaler blocks span it), before any sharding: every world size
sees the same bytes. It runs in chunks of whole blocks, reading the tensor piece by piece, so a loader holds the
tensor's parts (~n/2 bytes) plus one chunk, never the whole tensor; the result is bit-identical to
`to_nf4(tensor)` (a block's codes depend only on that block; the scalers come from the whole absmax vector).
Compute: `F.linear` on an NF4Tensor is torchao's `linear_nf4`: it dequantizes the whole weight (one temporary in
the compute dtype) in forward, and again in backward for the input gradient; the base gets no gradient.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from shardtune import quiet_imports

quiet_imports.install()  # before torchao's import logs its optional-kernel warnings
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (  # noqa: E402
    NF4Tensor,
    SubclassTensorArgs,
    to_nf4,
)

from shardtune.engine.nf4_layout import BLOCK, Nf4Layout, matrix_shape, scaler_block  # noqa: E402

CHUNK = 1 << 20  # most elements quantized at once: torchao's nearest-level search holds ~50 B/element (bf16)
# Fewest elements per chunk: ~3 MiB of temporaries, noise beside any loader's memory, while each chunk costs ~20
# tensor ops of fixed overhead. Without it a small weight went in 64 one-block chunks (a tiny QLoRA model's build on
# the simulated GPU, where every op runs through Python meta functions, spent a quarter of its time here).
FLOOR = 1 << 16


def chunk_numel(numel: int) -> int:
    """Elements per quantization chunk: whole blocks, at most 1/64 of the weight (so the temporaries, ~50 B per
    element, stay under the weight's own bf16 bytes: the loader's bound) but at least FLOOR, and at most CHUNK."""
    return max(BLOCK, min(CHUNK, max(FLOOR, numel // 64 // BLOCK * BLOCK)))


Writer = Callable[[int, torch.Tensor], None]  # (byte offset in the weight's region, uint8 bytes) -> store them


def quantize_into(write: Writer, read: Callable[[int, int], torch.Tensor], layout: Nf4Layout,
                  device: torch.device) -> None:
    """Quantize one weight and hand its NF4 parts to `write`, piece by piece, at their offsets in the weight's
    region (nf4_layout.py; alignment gaps are not written). `read(start, length)` returns that flat range of the
    weight (any float dtype); it is read twice (absmaxes, then codes), a chunk at a time, and each chunk is copied
    out of what `read` returned at once (a safetensors slice keeps its whole tensor's storage alive), so at any
    time this holds one chunk, its temporaries and the absmax vector (n/64 values), never the whole weight."""
    n, dtype = layout.numel, layout.dtype
    step = chunk_numel(n)
    if layout.transposed:
        read = expert_major(read, layout.shape)

    def chunk(a: int, m: int) -> torch.Tensor:
        return read(a, m).to(device=device, dtype=dtype, copy=True)  # own storage: the source dies here

    # Pass 1: per-block absmax over the whole tensor (n/64 values), then torchao's double quantization of it. Fed a
    # vector of absmaxes with block size 1, `double_quantize_scalers` computes exactly what it computes for the whole
    # tensor (the absmax of a 1-element block of a non-negative value is that value).
    absmax = torch.cat([chunk(a, min(step, n - a)).view(-1, BLOCK).abs().amax(dim=1) for a in range(0, n, step)])
    q_scalers, factors, mean = NF4Tensor.double_quantize_scalers(absmax, 1, scaler_block(n))
    del absmax
    write(layout.scalers, q_scalers.view(torch.uint8))
    write(layout.factors, _bytes(factors))
    write(layout.mean, _bytes(mean))
    # Pass 2: codes, chunk by chunk (a block's codes depend only on that block).
    nf4 = codebook(dtype, device)
    for a in range(0, n, step):
        m = min(step, n - a)
        codes = NF4Tensor.convert_to_norm_float_weight(chunk(a, m), m // BLOCK, BLOCK, nf4)
        write(layout.codes + a // 2, codes)
        del codes


def expert_major(read: Callable[[int, int], torch.Tensor], shape: torch.Size) -> Callable[[int, int], torch.Tensor]:
    """A reader of experts stored [E, in, out] that returns flat ranges of their transpose [E, out, in], so that the
    quantization blocks run along the input dim. One expert (in·out values, in the read's dtype) is read and
    transposed at a time and kept for the next reads: chunks come in order, so each expert is read once per pass."""
    e_numel, a, b = shape[1] * shape[2], shape[1], shape[2]
    cached: dict[int, torch.Tensor] = {}

    def expert(e: int) -> torch.Tensor:
        if e not in cached:
            cached.clear()
            cached[e] = read(e * e_numel, e_numel).reshape(a, b).t().contiguous().reshape(-1)
        return cached[e]

    def read_t(start: int, length: int) -> torch.Tensor:
        parts, pos = [], start
        while pos < start + length:
            e, off = divmod(pos, e_numel)
            m = min(e_numel - off, start + length - pos)
            parts.append(expert(e)[off:off + m])
            pos += m
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return read_t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A fresh dense copy of `t`'s values as uint8 (torchao's factors can be a strided 1-element view)."""
    return torch.empty(t.numel(), dtype=t.dtype, device=t.device).copy_(t.reshape(-1)).view(torch.uint8)


def quantize(read: Callable[[int, int], torch.Tensor], layout: Nf4Layout, device: torch.device) -> torch.Tensor:
    """The weight's whole region (uint8, layout.nbytes; zero gaps)."""
    region = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    quantize_into(lambda off, b: region[off:off + b.numel()].copy_(b), read, layout, device)
    return region


_CODEBOOK: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def codebook(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torchao's 16 NF4 levels (1D, `dtype`), taken from a 64-element to_nf4 so they are never retyped here."""
    key = (dtype, torch.device(device))
    if key not in _CODEBOOK:
        _CODEBOOK[key] = NF4Tensor.from_tensor(torch.ones(BLOCK * 2, dtype=dtype, device=device), BLOCK, 1).nf4
    return _CODEBOOK[key]


def nf4_view(buf: torch.Tensor, layout: Nf4Layout, *, cls: type[NF4Tensor] = NF4Tensor) -> NF4Tensor:
    """An NF4Tensor whose parts are views of `buf` (uint8, the weight's region): no copy, so refilling `buf` (the
    gathered unit, re-gathered for backward) refreshes every NF4Tensor autograd saved. `cls`: NF4Tensor or a
    subclass (nf4_linear.tiled_view's TiledNF4Tensor)."""
    n, dtype = layout.numel, layout.dtype
    sb = scaler_block(n)
    e = torch.empty((), dtype=dtype, device="meta").element_size()
    n_blocks = n // BLOCK
    rows, cols = matrix_shape(layout.shape, layout.transposed)  # 3-D experts: (experts·out, in) (nf4_experts.py)
    meta = SubclassTensorArgs(torch.Size((rows, cols)), (cols, 1), 0, dtype, buf.device, False)
    return cls(
        meta, BLOCK, n_blocks, sb,
        buf[layout.scalers:layout.scalers + n_blocks].view(torch.int8),  # quantized_scalers
        buf[layout.factors:layout.factors + n_blocks // sb * e].view(dtype),  # quantization_factor
        buf[layout.mean:layout.mean + e].view(dtype).view(()),  # scaler_mean
        buf[layout.codes:layout.codes + n // 2],  # quantized_data
        codebook(dtype, buf.device),
    )


def nf4_owning(buf: torch.Tensor, layout: Nf4Layout) -> NF4Tensor:
    """An NF4Tensor whose parts are copies of `buf`'s, each with its own storage, as torchao's `to_nf4` makes them:
    FSDP2's shards of it (torchao's split) are views of its parts, which would keep a shared region whole."""
    v = nf4_view(buf, layout)
    return NF4Tensor(SubclassTensorArgs(v.shape, v.stride(), v.storage_offset(), v.dtype, v.device, False),
                     v.block_size, v.n_blocks, v.scaler_block_size, v.quantized_scalers.clone(),
                     v.quantization_factor.clone(), v.scaler_mean.clone(), v.quantized_data.clone(), v.nf4)


def dequantize(buf: torch.Tensor, layout: Nf4Layout) -> torch.Tensor:
    """The weight as the matmul sees it, in the model's storage order (layout.shape, layout.dtype)."""
    w = nf4_view(buf, layout).get_original_weight().view(layout.quantized_shape)
    return w.transpose(-2, -1).contiguous() if layout.transposed else w


def quantize_parameters(module: torch.nn.Module, entries: list, dtype: torch.dtype) -> None:
    """engine.backend=torch: replace each (name, param, locations) entry by a frozen `nn.Parameter(NF4Tensor)` for
    FSDP2 to shard (torchao's fsdp_pre/post_all_gather gather its parts). `to_nf4` of the whole weight: the same
    bytes our engine stores (quantize_into is bit-identical to it)."""
    for _, p, locations in entries:
        w = to_nf4(p.detach().to(dtype), BLOCK, scaler_block(p.numel()))
        param = torch.nn.Parameter(w, requires_grad=False)
        for m, attr in locations:
            m._parameters[attr] = param
