"""Advice (single changes that make a plan fit) and the `--fit` search, ranked by a predicted step time.

Step-time model (an estimate for ranking, not a benchmark):
  compute   FLOPs / (peak bf16 TFLOP/s x MFU 0.4); fp32 compute at 1/4 of the bf16 rate. FLOPs per token:
            6·N for full fine-tuning (forward 2·N, backward 4·N), 4·N + 6·N_lora with LoRA (no weight gradients
            for the frozen base), +2·N with activation checkpointing (one more forward), plus causal attention
            6·L·s·d_q per token (forward 2·L·s·d_q: QKᵀ and AV over half the keys on average, x3 with backward).
  comm      ring collectives, per rank: all-gather (forward, and again in backward under full/hybrid sharding)
            and reduce-scatter of each unit, (W-1)/W of the buffer each way, over the intra-node link when the
            shard group fits in one node, else the inter-node link; hybrid adds one all-reduce of the gradient
            shard across nodes; LoRA adds one all-reduce of the adapter gradients.
  offload   host->device copy of every shard before each all-gather and device->host of the gradient shard at
            PCIe bandwidth, plus AdamW on the host at 10 GB/s of optimizer-state traffic.
  nf4       lora.quantize_base=nf4: all-gathers move NF4 bytes (~0.52 B/weight); every matmul over a quantized
            weight dequantizes it first (torchao: ~2·(8 + 3·c) bytes of memory traffic per weight: int64 nibble
            indices, looked-up and scaled halves, the stacked weight, written and read), in forward, in backward and
            in the checkpointed recompute, at the device's memory bandwidth; it does not overlap the matmuls.
            Tiled (engine.nf4_tile_mb, engine/nf4_linear.py): codes read (0.5 B), int32 index written and read
            (2 B each way), the tile written by the lookup, read and written by the scaling, read by the matmul
            (4·c): ~4.5 + 4·c bytes per weight per pass.
  host      kernel launches per step (plan/roofline.py estimated_launches: per layer, adapter, NF4 tile and
            micro-step, counted on the simulated GPU) x the host's time per launch (calibrated on an H200 run).
  step      max(compute, comm) + offload with prefetch on (comm overlaps compute), compute + comm + offload off;
            then the larger of that and the host's time: a host-bound step takes the host's.
            engine.backward_schedule=staggered adds what its backward exposes: each unit's reduction and gather
            overlap half of the unit's backward each (overlap: both share the whole of it), and the first unit's
            reduction runs alone.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from shardtune.config.schema import context_parallel_refusal
from shardtune.plan.candidate import Candidate
from shardtune.plan.estimate import Setup, estimate
from shardtune.plan.hardware import GiB
from shardtune.plan.long_context import long_context_options
from shardtune.plan.result import Plan, variant
from shardtune.plan.roofline import estimated_host_s
from shardtune.plan.same_run import canonical, distinct

MFU = 0.4
HOST_ADAM_GBPS = 10.0
GPUS_PER_NODE = 8
DEFAULT_LOSS_CHUNK = 1024  # the schema's train.loss_chunk_tokens default
DEFAULT_NF4_TILE = 64 << 20  # the schema's engine.nf4_tile_mb default


def step_time(plan: Plan) -> dict[str, float]:
    s, d, hw = plan.setup, plan.stats.dims, plan.hardware
    e = plan.estimate
    tokens = s.micro_batch * s.local_seq * s.grad_accum  # per rank per optimizer step
    n = plan.stats.num_params
    flops_tok = (4 * n + 6 * e.lora_params) if s.lora else 6 * n
    if s.checkpointing is not False:
        flops_tok += 2 * n
        if s.mlp_chunk:  # model/tiled_mlp.py: each chunk's MLP runs once more, in its own backward
            flops_tok += 2 * 3 * d.hidden * d.intermediate * d.num_layers
    attention = 6 * d.num_layers * s.seq_len * d.num_heads * d.head_dim  # per token
    rate = hw.bf16_tflops * 1e12 * MFU * (1.0 if s.compute.itemsize == 2 else 0.25)
    # engine.context_parallel: the last rank's queries attend to the whole row (model/context_parallel.py pads the
    # queries before its part), so the step waits for the row's whole attention on that rank
    compute = (flops_tok * tokens + attention * tokens * s.context_parallel) / rate

    W = s.shard_size
    per_node = max(1, s.world // s.nodes)
    link = hw.intra_node_gbps if W <= per_node else hw.inter_node_gbps
    c = s.compute.itemsize
    ag = sum(f.padded_numel * (1 if f.dtype.itemsize == 1 else c) for u in e.units for f in u.gathered)  # every unit
    rs = sum(u.trainable.padded_numel * s.reduce.itemsize for u in e.units if u.trainable)
    frac = (W - 1) / W if W > 1 else 0.0
    gathers = 2 if s.strategy in ("full_shard", "hybrid_shard") else 1
    reduces = s.grad_accum if s.sync_every_microstep else 1
    if s.strategy == "no_shard":
        byts = 0.0
        comm = 2 * (s.world - 1) / s.world * rs * reduces / (link * 1e9) if s.world > 1 else 0.0
    else:
        byts = frac * (gathers * ag * s.grad_accum + rs * reduces)
        if e.units and e.units[-1].vocab:  # vocab-parallel (engine/vocab.py): W·b·s·H moved 3x (4x: trainable embedding)
            moves = 3 + any(f.requires_grad for f in e.units[-1].vocab)
            byts += frac * moves * W * s.micro_batch * s.local_seq * d.hidden * c * s.grad_accum
        comm = byts / (link * 1e9)
        if s.strategy == "hybrid_shard" and s.world > W:
            r = s.world // W
            comm += 2 * (r - 1) / r * rs / W * reduces / (hw.inter_node_gbps * 1e9)
    if e.lora_params and s.world > 1:
        comm += 2 * (s.world - 1) / s.world * 4 * e.lora_params / (link * 1e9)
    offload = 0.0
    if s.offload and not s.device_is_cpu:
        shard = sum(f.shard_bytes() for u in e.units for f in u.flats)
        grads = sum(4 * u.trainable.shard_numel for u in e.units if u.trainable)
        offload = (gathers * s.grad_accum * shard + reduces * grads) / (hw.pcie_gbps * 1e9)
        offload += 16 * grads / 4 / (HOST_ADAM_GBPS * 1e9)
    if s.offload_activations and s.checkpointing is not False and not s.device_is_cpu:
        # engine/offload_activations.py: each checkpointed unit's input D2H in forward and H2D in backward, on the
        # copy stream: hidden under compute (the step waits only for what PCIe cannot keep up with)
        pcie = 2 * s.grad_accum * d.num_layers * s.micro_batch * s.local_seq * d.hidden * c / (hw.pcie_gbps * 1e9)
        compute = max(compute, pcie)
    nf4_weights = sum(math.prod(shape) for u in e.units for _, shape in u.quantized_weights)
    passes = 3 if s.checkpointing is not False else 2  # forward, backward (input grad), recompute
    per_weight = 4.5 + 4 * c if s.nf4_tile_bytes else 2 * (8 + 3 * c)
    dequant = passes * s.grad_accum * nf4_weights * per_weight / (hw.memory_gbps * 1e9)
    compute += dequant
    gpu = (max(compute, comm) + _staggered_exposure(s, e, compute, comm) if s.prefetch
           else compute + comm) + offload
    # The host issues the step's kernels one by one: a step whose launches take longer than its GPU time waits on
    # the host (plan/roofline.py's analytic launch estimate; `plan --simulate` counts them). No GPU on a CPU run.
    host = 0.0 if s.device_is_cpu else estimated_host_s(plan)
    total = max(gpu, host)
    return {"compute_s": compute, "comm_s": comm, "offload_s": offload, "dequant_s": dequant, "gpu_s": gpu,
            "host_s": host, "step_s": total, "tokens_per_s": tokens * s.world / total if total else 0.0}


def _staggered_exposure(s, e, compute: float, comm: float) -> float:
    """Backward communication the staggered schedule leaves exposed beyond the overlap schedule's (seconds per
    step). Per unit: its backward compute (2/3 of the step's), its reduction and (full/hybrid sharding) its
    re-gather, each ~1/3 of the unit's share of `comm` (one forward gather, one backward gather, one reduction)."""
    units = len(e.units)
    if s.backward_schedule != "staggered" or not units or s.strategy in ("shard_grad_op", "no_shard"):
        return 0.0
    half = compute * 2 / 3 / units / 2
    t = comm / units / 3
    per_unit = 2 * max(0.0, t - half) - max(0.0, 2 * t - 2 * half)
    return units * per_unit + t


def _world_variant(plan: Plan, world: int) -> Plan:
    nodes = plan.setup.nodes if world <= GPUS_PER_NODE * plan.setup.nodes else -(-world // GPUS_PER_NODE)
    hs = plan.setup.hybrid_shard_size
    return variant(plan, world=world, nodes=nodes, hybrid_shard_size=hs if hs and world % hs == 0 else None)


def _backend_variant(plan: Plan) -> Plan:
    """The recipe on our engine: the Setup resolved anew (vocab_parallel, the adapters' sharding and the NF4 tiles
    are ours only)."""
    r = plan.recipe
    recipe = dataclasses.replace(r, engine=dataclasses.replace(r.engine, backend="shardtune"))
    setup = Setup.from_recipe(recipe, world=plan.setup.world, nodes=plan.setup.nodes,
                              device_is_cpu=plan.setup.device_is_cpu)
    return Plan(recipe, plan.stats, setup, estimate(plan.stats, setup), plan.hardware)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def advice(plan: Plan) -> list[str]:
    """Each single change that makes the plan fit, with its predicted peak (best first)."""
    s = plan.setup
    tries: list[tuple[str, Plan]] = []
    if s.backend == "torch":  # FSDP2 holds more than ours (LoRA: the frozen base in the model's dtype, sharded adapters)
        tries.append(("engine.backend=shardtune", _backend_variant(plan)))
    if not s.offload:
        tries.append(("engine.cpu_offload=true", variant(plan, offload=True)))
    if s.checkpointing is False:
        tries.append(("engine.activation_checkpointing=true", variant(plan, checkpointing=True)))
    if s.compute.itemsize == 4:
        import torch

        tries.append(("engine.mixed_precision=bf16", variant(plan, compute=torch.bfloat16)))
    if not s.lora:
        tries.append(("lora.enabled=true", variant(plan, lora=True)))
        tries.append(("lora.enabled=true lora.quantize_base=nf4", variant(plan, lora=True, nf4=True)))
    elif not s.nf4:
        tries.append(("lora.quantize_base=nf4", variant(plan, nf4=True)))
    if s.strategy != "full_shard":
        tries.append(("engine.strategy=full_shard", variant(plan, strategy="full_shard")))
    split = _split(s, s.shard_size, s) if s.context_parallel == 1 and s.shard_size > 1 and \
        s.seq_len % s.shard_size == 0 and context_parallel_allowed(plan) else None
    if split is not None:  # the same global batch: each rank's share of the rows grows with the split
        tries.append((f"engine.context_parallel=true train.grad_accum={split.grad_accum} (same global batch)",
                      variant(plan, context_parallel=split.context_parallel, grad_accum=split.grad_accum)))
    mb = s.micro_batch
    while mb > 1:
        mb //= 2
        ga = s.grad_accum * s.micro_batch // mb
        tries.append((f"train.micro_batch_size={mb} train.grad_accum={ga} (same global batch)",
                      variant(plan, micro_batch=mb, grad_accum=ga)))
    for k in (2, 4, 8):
        tries.append((f"{s.world * k} GPUs (hardware.num_gpus / launch.nproc_per_node x launch.nnodes)",
                      _world_variant(plan, s.world * k)))
    out, seen_world = [], False
    for text, p in tries:
        if p.fits:
            if "GPUs" in text:
                if seen_world:
                    continue
                seen_world = True
            out.append((p.estimate.total, f"{text}: peak {_gib(p.estimate.total)} of {_gib(plan.usable)} usable"))
    if not out:
        return [f"no single change fits (peak {_gib(plan.estimate.total)} > {_gib(plan.usable)} usable): "
                "run `shardtune plan RECIPE --fit` to search combinations"]
    return [t for _, t in sorted(out)]


def context_parallel_allowed(plan: Plan) -> bool:
    """Whether engine.context_parallel could run this recipe: what config/schema.py and model/moe_checks.py (the
    sliding window) refuse."""
    return context_parallel_refusal(plan.recipe) is None and plan.stats.dims.window is None


def _split(setup: Setup, cp: int, recipe_setup: Setup) -> Setup | None:
    """`setup` with its rows split over `cp` ranks, at the recipe's global batch (the rows of a data-parallel rank
    grow with cp); None when that batch does not divide into the candidate's micro-batches."""
    rows = recipe_setup.micro_batch * recipe_setup.grad_accum * cp  # per data-parallel rank, x cp / recipe's cp
    if rows % recipe_setup.context_parallel or (rows // recipe_setup.context_parallel) % setup.micro_batch:
        return None
    return dataclasses.replace(setup, context_parallel=cp,
                               grad_accum=rows // recipe_setup.context_parallel // setup.micro_batch)


def fit_search(plan: Plan, *, try_lora: bool = False) -> list[Candidate]:
    """strategy x checkpointing x offload x micro-batch (x LoRA: bf16 or NF4 base) at the recipe's global batch;
    the ones that fit, fastest first."""
    s = plan.setup
    # rows per step per data-parallel rank: the ranks of a context-parallel group share theirs
    per_rank_batch = s.micro_batch * s.grad_accum
    can_split = context_parallel_allowed(plan)
    strategies = ["full_shard", "shard_grad_op", "no_shard"]
    if s.nodes > 1 or s.strategy == "hybrid_shard":
        strategies.append("hybrid_shard")
    micro = sorted({m for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_rank_batch and per_rank_batch % m == 0})
    # (lora, nf4): --lora adds LoRA over a bf16 base and over an NF4 base (QLoRA) to the recipe's own choice.
    loras = [(s.lora, s.nf4)] + ([(lo, q) for lo, q in ((True, False), (True, True), (False, False))
                                  if (lo, q) != (s.lora, s.nf4)] if try_lora else [])
    # Backward schedules: on a GPU overlap (faster) and staggered (one unit less backward memory) both compete.
    schedules = [s.backward_schedule] if s.device_is_cpu else ["overlap", "staggered"]
    # The chunked loss and the tiled NF4 matmul: the recipe's setting, and on when it is off (they cost
    # no predicted time: the same matmuls, less dequantization traffic). DPO keeps full logits (no chunking).
    chunks = sorted({s.loss_chunk, s.loss_chunk or DEFAULT_LOSS_CHUNK}) if plan.recipe.train.objective == "sft" \
        else [s.loss_chunk]
    tiles = sorted({s.nf4_tile_bytes, s.nf4_tile_bytes or DEFAULT_NF4_TILE}) if plan.recipe.engine.backend == "shardtune" \
        else [0]
    # engine.vocab_parallel (our backend): the recipe's setting, and on when it is off
    vps = sorted({s.vocab_parallel, plan.recipe.engine.backend == "shardtune" or s.vocab_parallel})
    # engine.shard_adapter_states (our backend): the recipe's setting, and on (the same bytes on the wire); it
    # changes nothing without LoRA, so those candidates take only the recipe's (no duplicate rows)
    sas = sorted({s.shard_adapter_states, plan.recipe.engine.backend == "shardtune" or s.shard_adapter_states})
    loras_sas = [(lo, q, sa) for lo, q in loras for sa in (sas if lo else [s.shard_adapter_states])]
    out, tried = [], set()
    for strategy, sched, ck, off, m, (lo, q, sa), chunk, tile, vp in itertools.product(
            strategies, schedules, (False, True), (False, True), micro, loras_sas, chunks, tiles, vps):
        setup = dataclasses.replace(s, strategy=strategy, checkpointing=ck, offload=off, micro_batch=m,
                                    grad_accum=per_rank_batch // m, lora=lo, nf4=q, loss_chunk=chunk,
                                    nf4_tile_bytes=tile, backward_schedule=sched, vocab_parallel=vp,
                                    shard_adapter_states=sa, context_parallel=1)
        # the recipe's engine.context_parallel splits over this candidate's shard group (one rank: no split)
        setup = _split(setup, setup.shard_size if s.context_parallel > 1 else 1, s)
        if setup is None or (setup := canonical(setup, s)) in tried:
            continue
        tried.add(setup)
        # The long-context knobs (plan/long_context.py) only ever add time: tried, in that order, only until one fits
        for offload_acts, mlp_chunk, cp in long_context_options(setup, can_split=can_split):
            setup = _split(dataclasses.replace(setup, offload_activations=offload_acts, mlp_chunk=mlp_chunk), cp, s)
            if setup is None:
                break
            p = variant(plan, **{f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)})
            # under 3 % headroom plan and the pre-flight warn (plan/headroom.py): --fit offers no such run
            if p.fits and not p.low_headroom:
                out.append(Candidate(p, step_time(p)))
                break
    # Equal predicted times are common (compute-bound with prefetch: comm hides under compute): prefer no offload,
    # no checkpointing, then the largest micro-batch (fewest micro-steps: the per-step overheads the model leaves
    # out), then the recipe's own strategy, loss chunking and NF4 tiling, so `train --fit` changes nothing it has no
    # reason to change. Candidates that are one run (plan/same_run.py) are listed once.
    return distinct(sorted(out, key=lambda c: (c.time["step_s"], c.plan.setup.offload, c.plan.setup.offload_activations,
                                      c.plan.setup.checkpointing is not False,
                                      -c.plan.setup.micro_batch, c.plan.setup.strategy != s.strategy,
                                      c.plan.setup.backward_schedule != s.backward_schedule,
                                      c.plan.setup.loss_chunk != s.loss_chunk,
                                      c.plan.setup.nf4_tile_bytes != s.nf4_tile_bytes,
                                      c.plan.setup.vocab_parallel != s.vocab_parallel,
                                      c.plan.setup.shard_adapter_states != s.shard_adapter_states,
                                      c.plan.setup.mlp_chunk != s.mlp_chunk)))
