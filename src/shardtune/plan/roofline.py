"""What a GPU would wait on: a step's GPU time at the card's rates (a roofline over the FLOPs and bytes the simulated
step counted, simulated/launches.py) against the host's time to issue its kernel launches; the verdict.

  gpu_s  = bf16 FLOPs / (bf16 peak x MATMUL_EFFICIENCY) + fp32 FLOPs / (fp32 peak x MATMUL_EFFICIENCY)
           + device bytes / (HBM bandwidth x HBM_EFFICIENCY) + link bytes / (link bandwidth x LINK_EFFICIENCY)
           Serial: no kernel is assumed to overlap another, nor a collective the compute (an upper bound on what
           a well-fed card takes; a lower bound on what the step can take).
  host_s = launches x HOST_S_PER_LAUNCH: the host issues kernels one after the other (Python, the dispatcher, the
           launch); a GPU that finishes a kernel before the next is issued waits.
  step_s = max(gpu_s, host_s): the host runs ahead of the GPU until the step's one host sync, and the GPU runs
           behind the host until its queue is empty. host-bound when host_s > gpu_s.

The constants are stated here to be calibrated by GPU runs (bench/gpu_session.sh). The one GPU measurement so far
(bench/RESULTS.md, one H200, stop 54: a 1.24B Llama LoRA at 4 x 2,048 tokens, 2,504 tokens/s, full fine-tuning
2,928 tokens/s) was host-bound, so it calibrates HOST_S_PER_LAUNCH only; the GPU efficiencies are the anchors' and
the datasheets' until a GPU-bound run measures them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import yaml

from shardtune.plan.hardware import HARDWARE_DIR, HardwareProfile

# A step's matmuls (cuBLAS, flash attention) at this fraction of the card's dense peak: the H200 ran one large bf16
# GEMM at 788 of 989 TFLOP/s (0.80, RESULTS stop 54); a whole 8B LoRA step reaches 0.41 MFU on an H100 (NeMo
# AutoModel, where the bytes-bound kernels take the rest of the time). Calibrate on a GPU-bound run.
MATMUL_EFFICIENCY = 0.7
# Memory-bound kernels (elementwise, norms, casts, the optimizer) at this fraction of the HBM bandwidth: what large
# elementwise kernels reach on A100/H100 (~80-90 % of the datasheet) less small kernels' ramp-up.
HBM_EFFICIENCY = 0.7
# Collectives at this fraction of the link's datasheet bandwidth (NCCL's bus bandwidth on NVLink: ~75-85 %).
LINK_EFFICIENCY = 0.8
# Host seconds per kernel launch in eager PyTorch (Python module code, the dispatcher, autograd, the launch itself),
# calibrated on the H200 run, whose code (c18073f^: one SDPA call per packed document) the simulated GPU counts at
# 37,079 launches per 1B LoRA step and 29,185 per full fine-tuning step (4 x 2,048 tokens): 3.27 s and 2.80 s per
# step measured (2,504 and 2,928 tokens/s, host-bound) give 88 and 96 us a launch (bench/RESULTS.md "Kernel
# launches per step"). That run's tokens/s left out optimizer.step() (a few hundred launches): a slight overestimate.
HOST_S_PER_LAUNCH = 90e-6


@dataclass(frozen=True)
class StepTime:
    gpu_s: float  # the roofline
    host_s: float  # launches x HOST_S_PER_LAUNCH
    tokens: int  # per optimizer step, all ranks
    card: str

    @property
    def step_s(self) -> float:
        return max(self.gpu_s, self.host_s)

    @property
    def verdict(self) -> str:
        return "host-bound" if self.host_s > self.gpu_s else "GPU-bound"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"card": self.card, "gpu_s": round(self.gpu_s, 5), "host_s": round(self.host_s, 5),
                "step_s": round(self.step_s, 5), "tokens_per_step": self.tokens,
                "tokens_per_s": round(self.tokens_per_s, 1), "verdict": self.verdict,
                "constants": {"matmul_efficiency": MATMUL_EFFICIENCY, "hbm_efficiency": HBM_EFFICIENCY,
                              "link_efficiency": LINK_EFFICIENCY, "host_s_per_launch": HOST_S_PER_LAUNCH}}

    def line(self) -> str:
        """The verdict in one line."""
        ratio = self.host_s / self.gpu_s if self.gpu_s else float("inf")
        return (f"{self.verdict} on {self.card}: host {self.host_s:.3f} s (launches x {HOST_S_PER_LAUNCH * 1e6:.0f} us) "
                f"vs GPU {self.gpu_s:.3f} s per step (roofline), host/GPU {ratio:.2f}; "
                f"~{self.tokens_per_s:,.0f} tokens/s")


@functools.cache
def fp32_tflops(hw: HardwareProfile) -> float:
    """The profile's `fp32_tflops` (dense fp32 on CUDA cores: nothing enables TF32), else a quarter of its bf16 rate."""
    path = HARDWARE_DIR / f"{hw.key}.yaml"
    data = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return float(data.get("fp32_tflops") or hw.bf16_tflops / 4)


def gpu_seconds(hw: HardwareProfile, *, flops_bf16: float, flops_fp32: float, device_bytes: float,
                link_bytes: float, link_gbps: float) -> float:
    """The roofline (module docstring) on profile `hw`; `link_gbps`: the link the step's collectives cross."""
    t = flops_bf16 / (hw.bf16_tflops * 1e12 * MATMUL_EFFICIENCY)
    t += flops_fp32 / (fp32_tflops(hw) * 1e12 * MATMUL_EFFICIENCY)
    t += device_bytes / (hw.memory_gbps * 1e9 * HBM_EFFICIENCY)
    return t + (link_bytes / (link_gbps * 1e9 * LINK_EFFICIENCY) if link_bytes else 0.0)


def step_time(hw: HardwareProfile, counts: dict[str, Any], *, tokens: int, link_gbps: float) -> StepTime:
    """`counts`: simulated/launches.py's `per_step` figures of one optimizer step."""
    gpu = gpu_seconds(hw, flops_bf16=counts["flops_bf16"], flops_fp32=counts["flops_fp32"],
                      device_bytes=counts["device_bytes"], link_bytes=counts["link_bytes"], link_gbps=link_gbps)
    return StepTime(gpu_s=gpu, host_s=counts["total"] * HOST_S_PER_LAUNCH, tokens=tokens, card=hw.key)


# -- the analytic launch estimate (plan, plan --fit: no simulated step) -------------------------------------------
# Launches per decoder layer per micro-step, (forward, recompute, backward), counted on the simulated GPU at 364d738
# on the 1.24B Llama at 2,048 tokens, bf16, checkpointing, 1 rank, cut to 1 and 2 decoder layers (the difference is
# one layer; tests/simulated/test_launch_estimate.py holds the estimate to the count): the full fine-tuning layer;
# what each LoRA-adapted Linear adds to it (LoRA minus full, / 7); what each NF4 weight adds (QLoRA minus LoRA, / 7:
# one tile each at 64 MB); what each further tile adds (engine.nf4_tile_mb=1, 116 tiles a layer, against 7); what
# each further MLP chunk adds (engine.mlp_chunk_tokens=1024: 2 chunks; measured under QLoRA, so its NF4 MLP
# weights re-run once more are in it). The code that issues them changes (issue 58 cuts launches): a cut that forgets
# these numbers fails that test; re-measure them as it says. Since: a block's adapters cast in one kernel (forward
# -13 a layer of 7 adapted Linears, moved from the adapter's term to the NF4 weight's, whose Linears keep peft's
# forward), and on one rank their gradients summed by blocks of Linears (model/lora_grads.py, backward -12 a layer).
LAYER_LAUNCHES = (28, 17, 53)
ADAPTER_LAUNCHES = (13 / 7, -6 / 7, 49 / 7)  # per adapted Linear (its recompute runs as part of the frozen base's)
# per adapted Linear whose gradients its block sums (one rank, our engine, a plain base weight): no casts, one add
BLOCK_SUMMED_LAUNCHES = (0, 0, -12 / 7)
# per adapted Linear on > 1 rank: its gradients into the replicated bucket (tiny-lora-cpu's 2-rank layer against 1B's)
ADAPTER_REPLICA_LAUNCHES = (0, 0, 2)
# per NF4 weight of a layer (its first tile, its block scalers; the backward reads the ones forward saved: 2 less)
NF4_WEIGHT_LAUNCHES = (32 / 7, 38 / 7, 63 / 7)
TILE_LAUNCHES = (436 / 109, 0, 920 / 109)  # per further NF4 tile (row tiles forward, column slabs backward)
# per further table lookup of a tile (engine/nf4_linear.py lookup_words: a large tile's index in pieces): its index
# cast and lookup, in forward, recompute and backward (tests/simulated/test_nf4_launches.py: 2 kernels a piece)
LOOKUP_PIECE_LAUNCHES = (2, 2, 2)
MLP_CHUNK_LAUNCHES = (102, -15, 283)  # per further chunk of engine.mlp_chunk_tokens, per layer
# per further NF4 tile of a chunked MLP, on top of TILE_LAUNCHES: its backward re-runs the chunk (nf4_tile_mb=1 and
# mlp_chunk_tokens=1024: 202 further tiles a layer, 186 of them the MLP's)
CHUNKED_TILE_LAUNCHES = (-30 / 186, 0, 331 / 186)
# per MoE layer, on top of the terms above (its NF4 experts counted as weights and tiles): the router, top-k, the
# permute and un-permute, the grouped experts (engine/nf4_experts.py); Qwen3-30B-A3B QLoRA at 1,024 tokens, 1 and 2
# layers, less what the terms above give it
MOE_LAYER_LAUNCHES = (59, 26, 132)
FIXED_LAUNCHES = {"full": 216, "lora": 63, "qlora": 99}  # per micro-step outside the layers (embedding, head, loss)
OPTIMIZER_LAUNCHES = {False: 36, True: 31}  # per step: foreach AdamW over all tensors, the next batch's copies
# FSDP2's launches a layer against ours without the block sums (FSDP2 takes none: it casts its adapters with every
# parameter, so neither cut changed its count): 1B LoRA at 4 x 2,048, 15,573 simulated (ours 10,983 before the cuts)
FSDP2_FACTOR = 1.54


def estimated_launches(plan: Any) -> int:
    """Kernel launches per optimizer step from the recipe's shape (the constants above): per micro-step, each layer's
    forward and backward, its recompute under checkpointing (every k-th layer for an int k), its adapters, NF4
    weights and tiles (the MLP's once per MLP chunk) and experts' routing; then the optimizer. Collectives: one per
    gathered unit and pass, one reduce-scatter per trainable unit."""
    import math

    from shardtune.plan.estimate import linear_targets

    s, layers = plan.setup, plan.stats.dims.num_layers
    adapted = len(linear_targets(plan.stats)) if s.lora else 0
    chunks = math.ceil(s.micro_batch * s.local_seq / s.mlp_chunk) if s.mlp_chunk else 1
    weights = extra_tiles = chunked_tiles = extra_pieces = 0
    if s.nf4:
        from shardtune.engine.nf4_linear import lookup_words

        per_tile = s.nf4_tile_bytes or 1 << 62  # torchao: the whole weight at once
        # engine.mlp_chunk_tokens (model/tiled_mlp.py): each chunk of tokens runs the MLP's weights, tiles and all
        for u in plan.estimate.units:
            for name, shape in u.quantized_weights:
                weights += 1
                tiles = math.ceil(math.prod(shape) * s.compute.itemsize / per_tile)
                runs = chunks if ".mlp." in name else 1
                extra_tiles += (tiles - 1) * runs
                if s.nf4_tile_bytes and len(shape) == 2:  # one lookup per 4 weights, lookup_words a piece
                    tile_words = min(math.prod(shape), per_tile // s.compute.itemsize) // 4
                    extra_pieces += tiles * (math.ceil(tile_words / lookup_words(per_tile)) - 1) * runs
                chunked_tiles += (tiles - 1) * chunks if ".mlp." in name and chunks > 1 else 0
        weights, extra_tiles, chunked_tiles, extra_pieces = (n / max(1, layers) for n in
                                                             (weights, extra_tiles, chunked_tiles, extra_pieces))
    recompute = 0.0 if s.checkpointing is False else 1.0 / (1 if s.checkpointing is True else int(s.checkpointing))
    replicas = adapted if s.world > 1 else 0
    block_summed = adapted if s.world == 1 and not s.nf4 and s.backend != "torch" else 0
    counts = (1.0, adapted, replicas, block_summed, weights, extra_tiles, extra_pieces, chunks - 1, chunked_tiles,
              float(bool(plan.stats.dims.moe)))
    per_phase = zip(LAYER_LAUNCHES, ADAPTER_LAUNCHES, ADAPTER_REPLICA_LAUNCHES, BLOCK_SUMMED_LAUNCHES,
                    NF4_WEIGHT_LAUNCHES, TILE_LAUNCHES, LOOKUP_PIECE_LAUNCHES, MLP_CHUNK_LAUNCHES,
                    CHUNKED_TILE_LAUNCHES, MOE_LAYER_LAUNCHES, strict=True)
    layer = sum(p * sum(n * c for n, c in zip(counts, costs, strict=True))
                for p, costs in zip((1.0, recompute, 1.0), per_phase, strict=True))
    if s.backend == "torch":
        layer *= FSDP2_FACTOR
    micro = layers * layer + FIXED_LAUNCHES["qlora" if s.nf4 else "lora" if s.lora else "full"]
    units = len(plan.estimate.units)
    gathers = (2 if s.strategy in ("full_shard", "hybrid_shard") else 1) if s.shard_size > 1 else 0
    comm = units * gathers + (units if not s.lora and s.world > 1 else 0)
    return round(s.grad_accum * (micro + comm) + OPTIMIZER_LAUNCHES[s.lora] + 1)


def estimated_host_s(plan: Any) -> float:
    """Host seconds per optimizer step: estimated launches x HOST_S_PER_LAUNCH."""
    return estimated_launches(plan) * HOST_S_PER_LAUNCH
