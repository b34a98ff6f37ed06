"""Byte layout of one NF4 weight: pure arithmetic, no torchao (nf4.py quantizes and computes), so `plan` and the
layout code size quantized buffers on a meta model without importing the implementation.

One weight of numel n (a multiple of BLOCK = 64) dequantized to dtype d (the compute dtype), one byte region:
    codes    uint8  n/2        two 4-bit codebook indices per byte; block k's 32 bytes at [32k, 32k+32)
    scalers  int8   n/64       per-block absmax, double-quantized (minus `mean`, times `factors`)
    factors  d      n/64/sb    one per scaler block of sb blocks (256, smaller for small weights: scaler_block)
    mean     d      1          mean of the block absmaxes
each part aligned to 8 bytes, the region padded to a whole number of 32-byte code blocks: ~0.516 bytes per weight
for d = bf16 (vs 2 bytes). The 16-entry codebook is a constant, never stored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 64  # weights per quantization block (QLoRA's and torchao's default)
BLOCK_BYTES = BLOCK // 2  # bytes of codes per block: shard boundaries fall on multiples of this
SCALER_BLOCK = 256  # blocks per double-quantization block (default; smaller when n/64 is not a multiple)
ALIGN = 8  # byte alignment of each part, so `view(dtype)` of the byte buffer is legal


def quantizable(shape: torch.Size) -> bool:
    """NF4 needs 2-D (Linear) weights whose numel is a whole number of blocks, or 3-D fused experts whose every
    expert is (so one expert, or a run of them, dequantizes on its own)."""
    return len(shape) in (2, 3) and math.prod(shape[1:] if len(shape) == 3 else shape) % BLOCK == 0


def matrix_shape(shape: torch.Size, transposed: bool = False) -> tuple[int, int]:
    """The 2-D matrix NF4 quantizes, blocks always along the input dim (as for a Linear's (out, in) weight): 3-D
    experts [E, out, in] as [E·out, in], rows of each expert consecutive; experts stored transposed ([E, in, out],
    gpt-oss) are quantized as their transpose, [E·out, in] too."""
    if len(shape) == 2:
        return shape[0], shape[1]
    return (shape[0] * shape[2], shape[1]) if transposed else (shape[0] * shape[1], shape[2])


FSDP2_MAX_SHARDS = 8  # engine.backend=torch splits every NF4 part by the shard count: keep them divisible


def scaler_block(numel: int) -> int:
    """Blocks per scaler block: 256 (QLoRA's), or for small weights the largest power of two that divides the number
    of blocks into a multiple of 8 scaler blocks (else into whole ones). Depends on the weight only, never on the
    world size: every world size and both backends quantize alike. (FSDP2 + torchao shards each NF4 part by rows,
    which needs the factor count divisible by the shard count.)"""
    n_blocks = numel // BLOCK
    for multiple in (FSDP2_MAX_SHARDS, 1):
        sb = SCALER_BLOCK
        while sb > 1 and n_blocks % (sb * multiple):
            sb //= 2
        if n_blocks % (sb * multiple) == 0:
            return sb
    return 1


def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Nf4Layout:
    """Where one weight's parts lie in a byte region of `nbytes` (a whole number of code blocks)."""

    shape: torch.Size  # as stored in the model
    dtype: torch.dtype  # dequantized dtype; factors and mean are stored in it
    codes: int  # offsets in bytes from the region's start
    scalers: int
    factors: int
    mean: int
    nbytes: int
    transposed: bool = False  # 3-D experts stored [E, in, out]: quantized (and dequantized) as [E, out, in]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def of(shape: torch.Size, dtype: torch.dtype, *, transposed: bool = False) -> Nf4Layout:
        n = math.prod(shape)
        assert quantizable(shape), shape
        e = torch.empty((), dtype=dtype, device="meta").element_size()
        n_factors = n // BLOCK // scaler_block(n)
        scalers = n // 2  # codes first: the region starts block-aligned, so every code block stays whole
        factors = _align(scalers + n // BLOCK)
        mean = _align(factors + n_factors * e)
        end = _align(mean + e, BLOCK_BYTES)  # the next weight's codes start on a block boundary too
        return Nf4Layout(torch.Size(shape), dtype, 0, scalers, factors, mean, end, transposed and len(shape) == 3)

    @property
    def quantized_shape(self) -> torch.Size:
        """The weight in the order its blocks run: `shape`, or [E, out, in] for experts stored transposed."""
        e, a, b = self.shape if len(self.shape) == 3 else (None, None, None)
        return torch.Size((e, b, a)) if self.transposed else self.shape


def nbytes_per_weight(shape: torch.Size, dtype: torch.dtype) -> int:
    return Nf4Layout.of(shape, dtype).nbytes
