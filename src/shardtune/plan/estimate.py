"""The memory model: per-rank peak bytes of one training step, as the sum of what is alive at the worst moment.

A step is walked as a few phases; each phase lists what is alive, by category, and the peak is the largest phase:
  forward-loss   all saved activations + the gathered units still held + logits (compute dtype), their fp32 copy
                 (flattened, shifted) and log_softmax's fp32 output
  loss-backward  same, but the CE tail is log_softmax output + its gradient + the gradient of its input (3 fp32
                 b·(s-1)·V tensors): usually the peak for large vocabularies
  norm-backward  same, the final RMSNorm's fp32 backward temporaries instead of the CE tail: the peak at long
                 sequences, where b·s·h outweighs the chunked loss
  unit-backward  inside a unit's MLP backward, the worst unit: root + that unit + the prefetched previous one
                 gathered or the next one's gradient in reduction (not both), the head's weight gradient (held
                 until the root reduces), the activations of that unit and the earlier ones, the sharded grads of
                 the later ones, the down-projection's weight grad and two b·s·i activation grads. The last unit
                 without checkpointing; with it, often the first
  unit-gradcat   end of it: its activations freed, its per-param grads + their flat concatenation (2·P); its
                 gathered buffer is already freed (at the last parameter grad)
  unit-reduce    after the engine frees the unit: the flat grad, its cast to reduce_dtype, the P/W output
  root-gradcat / root-reduce: the same for the root unit at the very end of backward (other units' grads sharded)
  optimizer      sharded params + grads + AdamW moments + per-parameter temporaries
  unit-gather    FSDP2 under cpu_offload only: a unit's backward prefetch, its shards copied to the device beside
                 two gathered units, before any recompute
  load           QLoRA on FSDP2 only: setup, the shards plus one unit's NF4 weights whole (not a step phase)
Model states are always alive: sharded params (fp32 master, or the frozen base in its dtype), AdamW moments
(allocated at the first step and kept), module buffers; sharded grads from earlier micro-steps.
Activations per decoder layer (HF Llama/Mistral/Qwen2 blocks, sdpa): what autograd saves, counted storage by storage
on this exact code path (counted with torch.autograd.graph.saved_tensors_hooks, transformers 5.x, sdpa):
  two RMSNorms: fp32 compute saves input, normalised and output (3·4 B·h); bf16 saves the fp32 upcast, the
  bf16 normalised and output (4 + 2·2 B·h);  q (rotated), k, v (repeated to all heads when a packing mask
  exists: eager only), attention output: 4 tensors;  MLP: gate, up, act(gate), act·up (4 × b·s·i);  the eager
  packing mask b·s²; softmax log-sum-exp b·heads·s fp32; two rsqrt b·s fp32.
Checkpointed units keep only their input (b·s·h) and recompute one unit's set during its backward.
Under LoRA the frozen base changes that set (lora_norms_mlp_bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shardtune.config.schema import Recipe, shard_group_size
from shardtune.engine.api import splits_vocab
from shardtune.engine.layout import UnitLayout
from shardtune.model.attention import WINDOW_BLOCK, varlen_applies
from shardtune.model.rotary import fused_in
from shardtune.plan import grpo
from shardtune.plan.moe import unpermute_bytes
from shardtune.plan.offload_host import table_grad_host_bytes
from shardtune.plan.stats import DTYPES, ModelStats

CATEGORIES = ("params", "grads", "optimizer", "gathered", "activations", "buffers")


AHEAD = 1  # engine/offload_activations.py: offloaded unit inputs fetched ahead of their recompute


def pinned_bytes(n: int, s: Setup) -> int:
    """A pinned host buffer of n bytes: CUDA's host caching allocator rounds each block up to a power of two. A CPU
    run's host buffers are plain allocations."""
    return n if s.device_is_cpu or n <= 0 else 1 << (n - 1).bit_length()


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The knobs plan varies (a recipe's values, or a `--fit` candidate)."""

    strategy: str
    world: int
    nodes: int
    hybrid_shard_size: int | None
    compute: torch.dtype  # all-gather / compute dtype
    reduce: torch.dtype
    checkpointing: bool | int
    offload: bool
    lora: bool
    micro_batch: int
    seq_len: int
    grad_accum: int
    sync_every_microstep: bool
    prefetch: bool
    packing: bool
    device_is_cpu: bool
    nf4: bool = False  # lora.quantize_base=nf4: the units' frozen Linear weights stored and gathered as NF4 bytes
    backward_schedule: str = "staggered"  # overlap | staggered (engine/unit.py; `auto` resolved by resolve_engine)
    loss_chunk: int = 0  # train.loss_chunk_tokens (engine/loss.py): tokens per chunk of the fused head + loss; 0: full logits
    nf4_tile_bytes: int = 0  # engine.nf4_tile_mb (engine/nf4_linear.py, our backend); 0: torchao's whole weight
    vocab_parallel: bool = False  # engine.vocab_parallel (engine/vocab.py, our backend): tables never gathered
    split_tables: bool = False  # engine.vocab_parallel on FSDP2: the untied embedding and head are units of their own
    shard_adapter_states: bool = False  # engine.shard_adapter_states (engine/replicated.py, our backend)
    backend: str = "shardtune"  # engine.backend: FSDP2 shards the adapters like any parameter (no bucket)
    offload_activations: bool = False  # engine.offload_activations (engine/offload_activations.py)
    mlp_chunk: int = 0  # engine.mlp_chunk_tokens (model/tiled_mlp.py): tokens per MLP chunk; 0: the whole sequence
    context_parallel: int = 1  # engine.context_parallel (model/context_parallel.py): ranks splitting each row
    compile: bool = False  # engine.compile
    lora_dropout: bool = False  # lora.dropout > 0 on a LoRA run

    @classmethod
    def from_recipe(cls, r: Recipe, *, world: int, nodes: int, device_is_cpu: bool) -> Setup:
        """The engine's knobs as train resolves them (trainer/resolve.py), the rest from the recipe."""
        from shardtune.trainer.resolve import resolve_engine

        p = resolve_engine(r, world_size=world, local_world_size=max(1, world // nodes), accelerator=not device_is_cpu)
        ours = r.engine.backend == "shardtune"
        return cls(strategy=p.strategy.value, world=world, nodes=nodes, hybrid_shard_size=p.hybrid_shard_size,
                   compute=p.mixed_precision.param_dtype, reduce=p.mixed_precision.reduce_dtype,
                   checkpointing=r.engine.activation_checkpointing, offload=p.cpu_offload, lora=r.lora.enabled,
                   micro_batch=rows_per_forward(r), seq_len=r.data.seq_len, grad_accum=r.train.grad_accum,
                   sync_every_microstep=p.sync_every_microstep, prefetch=p.prefetch, packing=r.data.packing,
                   device_is_cpu=device_is_cpu, nf4=p.quantize_base, backward_schedule=p.backward_schedule.value,
                   # DPO's log-probs take the full logits (trainer/dpo.py): the chunked loss is SFT's
                   loss_chunk=r.train.loss_chunk_tokens if r.train.objective == "sft" else 0,
                   nf4_tile_bytes=p.nf4_tile_bytes, vocab_parallel=p.vocab_parallel and ours,
                   split_tables=p.vocab_parallel and not ours,
                   shard_adapter_states=p.shard_replicated_states and ours, backend=r.engine.backend,
                   offload_activations=p.offload_activations, mlp_chunk=p.mlp_chunk_tokens,
                   context_parallel=context_parallel_size(r, world, nodes),
                   compile=r.engine.compile, lora_dropout=r.lora.enabled and r.lora.dropout > 0)

    @property
    def local_seq(self) -> int:
        """Tokens of each row this rank runs: the row, or its 1/N under engine.context_parallel."""
        return self.seq_len // self.context_parallel

    @property
    def recomputes(self) -> bool:
        """Checkpointed units recompute through engine/checkpointing.py's Function (its engine_recomputes, and the
        unit-level `replayable` as far as the recipe tells: no offloaded inputs, no chunks inside, no dropout; MoE
        blocks are checked where the model is known). Its backward runs the whole unit's backward while autograd
        still holds the unit's incoming gradient: one b·s·h more than torch's checkpoint (measured: exactly one,
        tests/plan_accuracy.py's checkpointed rows)."""
        from shardtune.engine.checkpointing import engine_recomputes

        return (engine_recomputes(backend=self.backend, compile=self.compile, nf4=self.nf4)
                and not self.lora_dropout and not self.offload_activations and not self.mlp_chunk
                and self.checkpointing is not False)

    @property
    def keeps_units(self) -> bool:
        """Units stay gathered from their forward to the end of backward: shard_grad_op, and no_shard on our
        engine (a unit's shard is the whole unit). FSDP2 frees the gathered copy after forward under no_shard too
        (engine/torch_backend.py: reshard_after_forward unless shard_grad_op) and gathers it again for backward."""
        return self.strategy == "shard_grad_op" or (self.strategy == "no_shard" and self.backend != "torch")

    @property
    def shard_size(self) -> int:
        if self.strategy == "no_shard":
            return 1
        if self.strategy == "hybrid_shard":
            return self.hybrid_shard_size or max(1, self.world // self.nodes)
        return self.world


def context_parallel_size(r: Recipe, world: int, nodes: int) -> int:
    """The ranks that split each row (engine.context_parallel: the shard group, on our backend), else 1."""
    if not r.engine.context_parallel or r.engine.backend != "shardtune":
        return 1
    return shard_group_size(r, world, max(1, world // nodes))


def rows_per_forward(r: Recipe) -> int:
    """Rows of one training forward. DPO runs a pair's chosen and rejected rows in one forward (2 x micro-batch);
    its reference costs no resident memory: precomputed log-probs (8 B per pair, host), or (LoRA) a no-grad forward
    of the same rows before the policy's, whose activations are freed before the policy forward starts."""
    return r.train.micro_batch_size * (2 if r.train.objective == "dpo" else 1)


@dataclass
class Estimate:
    per_rank: dict[str, int]  # category -> bytes at the peak phase, plus total_bytes
    peak_phase: str
    phases: dict[str, int]  # phase -> total bytes
    breakdown: dict[str, dict[str, int]]  # phase -> category -> bytes
    host_bytes: int  # per node: offloaded states of all its ranks
    host_per_rank: int
    units: list[UnitLayout] = field(default_factory=list)
    trainable_params: int = 0
    lora_params: int = 0

    @property
    def total(self) -> int:
        return self.per_rank["total_bytes"]


def activation_bytes_per_layer(stats: ModelStats, s: Setup) -> int:
    d, b, n = stats.dims, s.micro_batch, s.local_seq
    c = _size(s.compute)
    bs = b * n
    q_dim = d.num_heads * d.head_dim
    # sdpa runs one causal call per document (model/attention.py): no mask, k/v not repeated. eager: HF's (b,1,s,s) mask
    # for packed rows, and k/v repeated to every head.
    mask = s.packing and stats.recipe.model.attn_implementation == "eager"
    kv_dim = q_dim if mask else d.num_kv_heads * d.head_dim
    attn = bs * c * (2 * q_dim + 2 * kv_dim)  # q, attention output, k, v
    if s.context_parallel > 1:
        # model/context_parallel.py on the last rank (the largest; the plan takes one document of the whole row): the
        # gathered k and v of the row, the queries padded to the row and the padded output (both saved by SDPA),
        # the output's part then assembled (as the per-document path does)
        row = b * s.seq_len
        attn = row * c * (2 * q_dim + 2 * kv_dim) + bs * c * q_dim
    # On a GPU in bf16 (model/attention.py `varlen_applies`), packed rows and windowed documents are one varlen call:
    # q, k, v and the output as above, nothing more. Elsewhere:
    # Packed SFT rows, per-document calls (model/attention.py): each call's output (saved by SDPA) and their concatenation
    # are two tensors. DPO rows are one causal call each.
    # A document longer than the sliding window (model/attention.py `_Band`; the plan takes the worst case, one
    # document of seq_len): k and v repeated to every head (CUDA's kernel that takes a bias reads no grouped heads)
    # and saved so, the query blocks' outputs then their concatenation, and the band bias of B x (B + W - 1).
    varlen = varlen_applies(on_gpu=not s.device_is_cpu, dtype=s.compute, head_dim=d.head_dim,
                            dropout=d.attention_dropout)
    band = (d.window is not None and d.window < n and stats.recipe.model.attn_implementation != "eager"
            and not varlen)
    if band:
        # the repeated k and v replace k and v, but k's bytes stay where the fused rotary made q and k views of one
        # tensor (model/rotary.py): the blocks' SDPA calls save views of q
        attn += bs * c * (2 * (q_dim - kv_dim) + (kv_dim if fused_in(stats.model) else 0))
    packed = s.packing and not mask and stats.recipe.train.objective == "sft" and not varlen
    if s.context_parallel == 1 and (band or packed):
        attn += bs * c * q_dim
    if 0 < s.mlp_chunk < bs:  # model/tiled_mlp.py: MLP, norms and adapter branches over sequence chunks
        norms, mlp = chunked_norms_mlp_bytes(stats, s)
    elif s.lora:
        norms, mlp = lora_norms_mlp_bytes(stats, s)
    else:
        norms = 2 * bs * d.hidden * (4 + 2 * c)  # fp32: in/normed/out; bf16: fp32 upcast + normed + out
        mlp = 4 * bs * d.intermediate * c
    lse = b * d.num_heads * s.seq_len * 4  # SDPA's log-sum-exp, per query (the last rank's: the whole row)
    extra = (b * n * n * c if mask else 0) + lse + 2 * bs * 4
    if band:
        block = min(d.window, WINDOW_BLOCK)
        extra += block * (block + d.window - 1) * c
    if d.moe:
        extra += routing_bytes(stats, d, bs, c, lora_experts=s.lora)
    if stats.recipe.model.attn_implementation == "eager":
        extra += b * d.num_heads * n * n * (4 + c)  # softmax output (fp32) and its cast, saved for backward
    return norms + attn + mlp + extra


def routing_bytes(stats: ModelStats, d, tokens: int, c: int, *, lora_experts: bool) -> int:
    from shardtune.plan.moe import routing_bytes as moe_routing

    experts = stats.expert_adapter_numel() // d.num_layers if lora_experts else 0
    return moe_routing(d.moe, d.hidden, tokens, c, lora=lora_experts and experts > 0, adapter_numel=experts)


def lora_norms_mlp_bytes(stats: ModelStats, s: Setup) -> tuple[int, int]:
    """Norms and MLP under LoRA (measured with saved_tensors_hooks, peft 0.x, fp32 and bf16). A frozen weight
    needs no saved input: each RMSNorm keeps only its fp32 input (or upcast), the MLP gate, up and act(gate), not
    act·up. Each adapter saves its input in the adapters' dtype (fp32): in fp32 compute the base's own input tensor
    (shared by modules reading the same tensor; o_proj's is the attention output, saved anyway), in bf16 one fp32
    cast per adapted module; plus its (b·s, r) lora_A output. Over a plain weight our LoRA Linear
    (model/lora_linear.py) computes the adapter in the compute dtype, and FSDP2 (engine.backend=torch) casts the
    adapters to it with every other parameter: no cast, every saved adapter tensor in the compute dtype. peft's
    fp32 path remains for QLoRA on our engine (the NF4 weight computes through its own Function)."""
    d, bs, c = stats.dims, s.micro_batch * s.local_seq, _size(s.compute)
    a = _adapter_compute_size(s)
    q_dim, r = d.num_heads * d.head_dim, stats.recipe.lora.r
    inputs = {"q_proj": ("attn_in", d.hidden), "k_proj": ("attn_in", d.hidden), "v_proj": ("attn_in", d.hidden),
              "o_proj": ("attn_out", q_dim), "gate_proj": ("mlp_in", d.hidden), "up_proj": ("mlp_in", d.hidden),
              "down_proj": ("mlp_act", d.intermediate)}
    targets = [t for t in linear_targets(stats) if t in inputs]
    if a == c:  # no cast: one saved tensor per distinct input; the attention output is already counted
        distinct = {inputs[t][0]: inputs[t][1] for t in targets}
        adapter_in = sum(bs * width * c for key, width in distinct.items() if key != "attn_out")
    else:
        adapter_in = sum(bs * inputs[t][1] * 4 for t in targets)
    norms = 2 * bs * d.hidden * 4
    mlp = 3 * bs * d.intermediate * c + adapter_in + len(targets) * bs * r * a  # adapters counted with the MLP
    return norms, mlp


def adapter_sum_bytes(stats: ModelStats, s: Setup) -> int:
    """peft's adapter branch, recomputed or run forward in the adapters' dtype: lora_B's output and its scaled copy
    (then the sum), two b·s·out tensors alive at once beside the base's output, for the widest adapted Linear. In
    bf16 compute with fp32 adapters (our engine) they are fp32: twice the two b·s·i gradients the MLP backward
    holds, and the layer's peak (measured: the tiny-lora-cpu step on the simulated GPU peaks at up_proj's scaled
    copy in the last checkpointed unit's recompute). engine.mlp_chunk_tokens' LoraDelta makes none of them, nor
    does our LoRA Linear (model/lora_linear.py: the adapter is added into the base's output), used wherever the
    base weight is a plain tensor: peft's branch remains under QLoRA only."""
    if not s.lora or not s.nf4 or 0 < s.mlp_chunk < s.micro_batch * s.local_seq:
        return 0
    d = stats.dims
    widths = {"q_proj": d.num_heads * d.head_dim, "k_proj": d.num_kv_heads * d.head_dim,
              "v_proj": d.num_kv_heads * d.head_dim, "o_proj": d.hidden, "gate_proj": d.intermediate,
              "up_proj": d.intermediate, "down_proj": d.hidden}
    out = max((widths[t] for t in linear_targets(stats) if t in widths), default=0)
    return 2 * s.micro_batch * s.local_seq * out * _adapter_compute_size(s)


def _adapter_compute_size(s: Setup) -> int:
    """Bytes per element of the adapter branch's tensors: the compute dtype's (our LoRA Linear; FSDP2 casts the
    adapters), fp32 under QLoRA on our engine (peft's branch, with the adapters kept in fp32)."""
    return 4 if s.nf4 and s.backend != "torch" else _size(s.compute)


def linear_targets(stats: ModelStats) -> list[str]:
    """The Linear names peft adapts, as the engine resolves lora.target_modules (`auto`: q_proj and v_proj)."""
    from shardtune.model.moe_checks import resolve_targets

    return resolve_targets(stats.model, stats.recipe.lora.target_modules).linear


def chunked_norms_mlp_bytes(stats: ModelStats, s: Setup) -> tuple[int, int]:
    """Norms and MLP with engine.mlp_chunk_tokens = C (model/tiled_mlp.py, model/chunked_lora.py). Each norm chunk saves a view
    of its input: the unit input (counted apart) and the residual after attention (b·s·h); the two norm outputs are
    saved by their readers: the attention input by q/k/v (their weight grads; under LoRA only when an adapter reads
    it, LoraDelta keeping it in the compute dtype), the MLP input by the MLP chunks, unless the post-attention norm
    runs inside the MLP's chunks (`norm_feeds_only_mlp`: Llama, Mistral, Qwen, Mixtral, gpt-oss), whose saved
    inputs are then views of the residual. One chunk's MLP set at a time
    (its recompute, then its backward): gate, up, act(gate), act·up (LoRA: act·up only as down's adapter input).
    Every adapter keeps its (b·s, r) fp32 lora_A output; no fp32 copy of any input."""
    d, bs, c = stats.dims, s.micro_batch * s.local_seq, _size(s.compute)
    C = s.mlp_chunk
    targets = set(linear_targets(stats)) if s.lora else set()
    attn_in = not s.lora or bool(targets & {"q_proj", "k_proj", "v_proj"})
    norms = bs * d.hidden * c * (1 + (not fused_norm_mlp(stats)) + attn_in)
    if not s.lora:
        return norms, 4 * C * d.intermediate * c
    named = targets & {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    mlp = (3 + ("down_proj" in targets)) * C * d.intermediate * c + len(named) * bs * stats.recipe.lora.r * 4
    return norms, mlp


def fused_norm_mlp(stats: ModelStats) -> bool:
    """Whether engine.mlp_chunk_tokens runs the post-attention norm inside the MLP's chunks (model/tiled_mlp.py)."""
    from shardtune.model.tiled_mlp import MLP_CHILD, norm_feeds_only_mlp

    block = next((m for m in stats.model.modules() if hasattr(m, MLP_CHILD)), None)  # the first decoder block
    return block is not None and norm_feeds_only_mlp(block)


def nf4_matmul_bytes(units: list[UnitLayout], c: int) -> int:
    """The transient of a matmul over an NF4 weight of n elements (torchao's linear_nf4 -> get_original_weight, in
    forward and again in backward for the input gradient): both nibble index tensors as int64 (8n), the two looked-up
    halves, the two scaled halves and the stacked weight (3·c·n), the dequantized scalers (c·n/64). Measured with the
    CPU tracker: 14.03 B/weight in bf16, 20.06 in fp32. The largest quantized weight sets it (the MLP's)."""
    n = max((math.prod(shape) for u in units for _, shape in u.quantized_weights), default=0)
    return n * (8 + 3 * c) + n * c // 64


def nf4_tile_bytes(units: list[UnitLayout], c: int, tile: int, tokens: int,
                   mlp_tokens: int) -> tuple[int, int]:
    """engine/nf4_linear.py: (the reused tile buffer, alive from the first matmul on; the transient of one tiled
    matmul). The buffer holds the largest tile of any weight (compute dtype); the transient is the tile's int32 code
    index (one per two code bytes: 1 B/weight of the tile, in pieces of at most lookup_words' for a large tile)
    and the weight's block scalers (c/64 B/weight, computed once per matmul); for a weight of several tiles the backward's column slab (the same index, one slab's product, tokens x cols x c, cols
    capped so that it fits the tile too; an MLP weight sees `mlp_tokens`, one chunk of model/tiled_mlp.py) or,
    when rows split blocks, the fp32 input-gradient accumulator (tokens x in x 4) with one row tile's product
    (tokens x in x c)."""
    from shardtune.engine.nf4_linear import cols_per_tile, lookup_words, rows_per_tile
    from shardtune.model.tiled_mlp import MLP_CHILD
    from shardtune.plan.moe import nf4_experts_bytes

    buf, transient = 0, 0
    piece = 4 * lookup_words(tile)  # bytes of one lookup's int32 index
    for u in units:
        for name, shape in u.quantized_weights:
            if len(shape) == 3:  # fused experts (plan/moe.py)
                run_buf, run_transient = nf4_experts_bytes(tuple(shape), c, tile)
                buf, transient = max(buf, run_buf), max(transient, run_transient)
                continue
            out_f, in_f = shape
            n = mlp_tokens if f".{MLP_CHILD}." in f".{name}" else tokens  # the MLP sees one chunk (model/tiled_mlp.py)
            rows = rows_per_tile(out_f, in_f, c, tile)
            cols = cols_per_tile(out_f, in_f, c, tile, n) if rows < out_f else 0
            buf = max(buf, rows * in_f * c, out_f * cols * c)
            scalers = out_f * in_f // 64 * c
            if cols:
                bwd = min(out_f * cols, piece) + n * cols * c
            else:
                bwd = min(rows * in_f, piece) + (n * in_f * (4 + c) if rows < out_f else 0)
            transient = max(transient, scalers + max(min(rows * in_f, piece), bwd))
    return buf, transient


def nf4_saved_scalers(blocks: list[UnitLayout], c: int, s: Setup) -> int:
    """engine/nf4_linear.py: each tiled NF4 matmul saves its weight's block scalers (c/64 B/weight) for its
    backward: a recomputed (or not checkpointed) unit keeps those of all its 2-D NF4 weights; the largest unit's."""
    if not (s.nf4 and s.lora and s.nf4_tile_bytes):
        return 0
    return max((sum(math.prod(shape) for _, shape in u.quantized_weights if len(shape) == 2) // 64 * c
                for u in blocks), default=0)


def loss_bytes(stats: ModelStats, s: Setup, head_trains: bool, vocab_rows: int = 0) -> tuple[int, int]:
    """(forward, backward) transient of the loss, on top of the saved activations.
    Full logits: logits (b·s·V, compute dtype), their fp32 flattened shifted copy and log_softmax's output; in
    backward log_softmax's output, its gradient and the gradient of its input (3 fp32 b·(s-1)·V).
    Chunked (engine/loss.py): one chunk's logits in fp32 (C·V·4; in bf16 also the bf16 logits, then the bf16 gradient:
    C·V·2) while the gradients are formed in forward: grad_h (b·s·H, compute dtype) and, when the head trains,
    grad_W (V·H, fp32: summed over the chunks in fp32). Both stay until the backward takes them (scaled in place).
    Vocab-parallel (`vocab_rows` R = ceil(V/W) local rows, engine/vocab.py): the chunks run over the W·b·s gathered
    tokens against R rows; the gathered hidden states and their gradient (2·W·b·s·H) live during the loop, the
    rank's own grad_h (b·s·H) and the local rows' gradient (R·H) after it. Without chunking: the local logits of all
    gathered tokens and the all-to-all's output (each ~b·s·V), freed before the full-logits fp32 tensors peak."""
    d, c = stats.dims, _size(s.compute)
    V, tokens = d.vocab, s.micro_batch * s.local_seq
    if vocab_rows:
        W = s.shard_size
        full_fwd, full_bwd = loss_bytes(stats, s, head_trains)
        if not s.loss_chunk:  # measured: the all-to-all's buffers are gone before the full logits' forward peak;
            # its backward holds the logits' gradient, its padded copy and the all-to-all's two buffers (b·s·V each).
            # The head saves the gathered hidden states (W·b·s·H) for its backward, which adds their gradient's
            # partial sums (g @ weight, W·b·s·H) before scatter_sum (engine/vocab.py _VocabLogits)
            gathered = W * tokens * d.hidden * c
            return full_fwd + gathered, max(full_bwd, 4 * tokens * V * c) + 2 * gathered
        G = W * tokens
        C = min(s.loss_chunk, G)
        grads = tokens * d.hidden * c + (vocab_rows * d.hidden * 4 if head_trains else 0)
        return C * vocab_rows * 4 + (C * vocab_rows * c if c != 4 else 0) + 2 * G * d.hidden * c + G * 8 + grads, grads
    if not s.loss_chunk:
        rows = s.micro_batch * (s.local_seq - 1)
        return tokens * V * c + 2 * rows * V * 4, 3 * rows * V * 4
    C = min(s.loss_chunk, tokens)
    grads = tokens * d.hidden * c + (V * d.hidden * 4 if head_trains else 0)
    return C * V * 4 + (C * V * c if c != 4 else 0) + grads, grads


def offloaded_host_bytes(units: list[UnitLayout], s: Setup) -> int:
    """cpu_offload's shards and sharded gradients on the host, as the engine allocates them: each shard a pinned
    buffer at its exact size (accelerator.host_resident: not the caching host allocator's power-of-two blocks);
    each unit's reduced gradient copied into a pinned buffer that becomes the fp32 gradient (reduce fp32), or is added into a pageable fp32 one (bf16: both alive
    when the gradients are added); with reductions on several micro-steps, one more copy per unit waits to be added
    (engine/reduce.py `_add_earlier_copy`); the vocabulary tables' row gradients (plan/offload_host.py)."""
    r = _size(s.reduce)
    later_copy = s.grad_accum > 1 and s.sync_every_microstep
    total = 0
    for u in units:
        total += sum(f.shard_bytes() for f in u.flats)
        total += sum(table_grad_host_bytes(f, replicated=s.world > s.shard_size, grad_accum=s.grad_accum)
                     for f in u.vocab)
        if u.trainable is not None:
            n = u.trainable.shard_numel
            total += 4 * n if r == 4 else 4 * n + r * n
            total += r * n if later_copy else 0
    return total


def root_activation_bytes(stats: ModelStats, s: Setup) -> int:
    """Saved outside the units: final norm, rotary cos/sin (shared by all layers), input ids."""
    d, bs = stats.dims, s.micro_batch * s.local_seq
    c = _size(s.compute)
    return bs * d.hidden * (4 + 2 * c) + 2 * bs * d.head_dim * c + bs * 8 + bs * 4


def adapter_runs(stats: ModelStats, s: Setup) -> tuple[int, int]:
    """(numel of the adapters whose gradient and AdamW state this rank holds at most, numel of the fp32 bucket of
    local sums): every adapter and one bucket of all of them, or (shard_adapter_states over 2+ ranks) the largest
    rank's contiguous run M and the padded bucket W·M (engine/replicated.py, the same partition)."""
    from shardtune.engine.replicated import partition, run_sizes

    sizes = stats.lora_sizes()
    if s.backend == "torch":  # FSDP2 shards each adapter like any parameter, over the shard group (dim 0, padded)
        own = sum(-(-n // s.shard_size) for n in sizes)
        return own, 0
    if not (s.shard_adapter_states and s.world > 1):
        return sum(sizes), sum(sizes)
    largest = max(run_sizes(sizes, partition(sizes, s.world), s.world))
    return largest, s.world * largest


@dataclass(frozen=True, kw_only=True)
class StepFacts:
    """What every phase of one setup's step reads: the units as the engine shards them and the sizes they imply."""

    c: int  # bytes per element of the compute (all-gather) dtype
    r: int  # bytes per element of the reduce dtype
    W: int  # shard group size
    units: list[UnitLayout]  # the decoder units in forward order, then the root
    blocks: list[UnitLayout]  # the decoder units
    root: UnitLayout  # embeddings, final norm, head: gathered before unit 0, resharded after the last backward
    # A shard group of one rank whose shard is already in the compute dtype computes on its shard (flat_param.py
    # `aliased`), unless the shard is offloaded: then the unit is copied in and gathered as at any W.
    aliased: bool
    vp: bool  # vocab_parallel, as shard.shard_model applies it: only with a shard group of 2+ ranks
    vocab_rows: int  # vocab_parallel: the local rows R of each row-sharded table (never gathered); else 0
    vocab_train: int  # numel of the trainable row-sharded tables' local rows (counted with the params' shards)
    tokens: int  # b·s of one forward
    bsh: int  # bytes of one b·s·h activation (compute dtype): a unit's input
    block_gathered: list[int]  # each decoder unit's unsharded buffer(s)
    root_gathered: int  # the root's
    tile_buf: int  # NF4 tiled matmul: the reused tile buffer (engine/nf4_linear.py), alive from the first matmul
    dequant: int  # NF4: the transient of one matmul's dequantization


def step_facts(stats: ModelStats, s: Setup) -> StepFacts:
    d, c, W = stats.dims, _size(s.compute), s.shard_size
    # The frozen base is stored in the compute dtype by our engine (trainer/parallelize.py: bf16 shards, no cast before the
    # all-gather) and as NF4 bytes under QLoRA; FSDP2 keeps it in the model's dtype and casts it at each all-gather,
    # except the NF4 weights under QLoRA (the rest of its base, tables and norms, stays in the model's dtype).
    base_dtype = s.compute if s.lora and s.backend == "shardtune" else DTYPES[stats.recipe.model.dtype]
    vp = splits_vocab(s.vocab_parallel, shard_size=W)  # as the backends: only with a shard group of 2+ ranks
    units = stats.layouts(W, frozen_base=s.lora, base_dtype=base_dtype, nf4=s.nf4 and s.lora, nf4_dtype=s.compute,
                          vocab_parallel=vp)
    *blocks, root = units
    aliased = W == 1 and not (s.offload and not s.device_is_cpu)
    tokens = s.micro_batch * s.local_seq
    tile_buf = 0
    if s.nf4 and s.lora and s.nf4_tile_bytes:
        tile_buf, dequant = nf4_tile_bytes(units, c, s.nf4_tile_bytes, tokens,
                                           min(tokens, s.mlp_chunk) if s.mlp_chunk else tokens)
    else:
        dequant = nf4_matmul_bytes(units, c)
    return StepFacts(c=c, r=_size(s.reduce), W=W, units=units, blocks=blocks, root=root, aliased=aliased, vp=vp,
                     vocab_rows=root.vocab[0].shard_numel // d.hidden if root.vocab else 0,
                     vocab_train=sum(f.shard_numel for f in root.vocab if f.requires_grad), tokens=tokens,
                     bsh=tokens * d.hidden * c, block_gathered=[gathered_bytes(u, s, c, aliased) for u in blocks],
                     root_gathered=gathered_bytes(root, s, c, aliased), tile_buf=tile_buf, dequant=dequant)


def gathered_bytes(u: UnitLayout, s: Setup, c: int, aliased: bool) -> int:
    """The unsharded buffer(s) of a unit: compute dtype (c bytes), NF4 bytes as bytes. Aliased (one rank): the shard
    is the buffer, for NF4 bytes too unless offloaded (engine/quantized.py)."""
    return sum((0 if aliased and not s.offload else f.padded_numel) if f.dtype == torch.uint8
               else 0 if aliased and f.dtype == s.compute else f.padded_numel * c for f in u.gathered)


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Sharded params, grads and AdamW state: where they live, and the gradients the backward holds beside them."""

    static: dict[str, int]  # alive in every phase on the device: params, optimizer, buffers
    grads: int  # the sharded grads on the device once backward is done
    grads_prev: int  # earlier micro-steps' grads, alive through the whole step
    head_grad: int  # the head's weight gradient, held from the loss to the root's reduction
    root_grad: int  # the root's sharded fp32 grad on the device, made by the root's reduction (the last)
    unit_grads: list[int]  # each decoder unit's sharded fp32 grad on the device, made by its reduction
    bucket: int  # the adapters' (and hybrid: the trainable tables') fp32 gradient bucket during backward
    bucket_prev: int  # the same bucket, pending through the forward of a later micro-step
    host_per_rank: int  # cpu_offload: the states on the host
    lora_params: int  # the adapters' numel, 0 without LoRA
    lora_own: int  # numel of the adapters whose gradient and AdamW state this rank holds
    lora_bucket: int  # numel of the adapters' fp32 bucket of local sums


def model_states(stats: ModelStats, s: Setup, step: StepFacts) -> ModelStates:
    d, units, root = stats.dims, step.units, step.root
    shard_bytes = sum(f.shard_bytes() for u in units for f in u.flats)
    train_shard = sum(u.trainable.shard_numel for u in units if u.trainable) + step.vocab_train
    lora_p = stats.lora_params() if s.lora else 0
    # The adapters (engine/replicated.py): values whole on every rank; their gradient and AdamW state whole too, or
    # (shard_adapter_states) this rank's run only (at most lora_own); the fp32 bucket of local sums, lora_bucket.
    lora_own, lora_bucket = adapter_runs(stats, s) if s.lora else (0, 0)
    # The adapters' fp32 values: whole on every rank beside the units (ours), or sharded like any parameter (FSDP2)
    states_params = shard_bytes + 4 * (lora_own if s.backend == "torch" else lora_p)
    grads_full = 4 * train_shard + 4 * lora_own
    opt = 8 * train_shard + 8 * lora_own
    # Grads of earlier micro-steps: sharded fp32 (sync every micro-step) or unsharded fp32 per unit (no sync). The
    # adapters' wait in the bucket (counted below) until the step's last backward: nothing in their .grad. One rank
    # (no bucket: autograd accumulates in .grad) and FSDP2 (held like any gradient, counted whole) hold it.
    grads_prev = adapters_prev = 0
    if s.grad_accum > 1:
        adapters_prev = 4 * lora_p if s.backend == "torch" or s.world == 1 else 0
        grads_prev = adapters_prev + (4 * train_shard if s.sync_every_microstep else
                                      sum(4 * u.trainable.padded_numel for u in units if u.trainable))
    host_per_rank = 0
    dev_params, dev_grads, dev_opt = states_params, grads_full, opt
    if s.offload and s.backend == "torch":  # FSDP2: every shard (adapters too), its fp32 gradient, AdamW on the host
        host_per_rank = states_params + grads_full + opt
        grads_prev = 0
        if not s.device_is_cpu:
            dev_params = dev_grads = dev_opt = 0
    elif s.offload:  # model states move to the host; the device keeps the adapters' and what is gathered and in flight
        host_per_rank = offloaded_host_bytes(units, s) + opt - 8 * lora_own
        grads_prev = adapters_prev if s.sync_every_microstep else grads_prev
        if not s.device_is_cpu:  # on a CPU run the host IS the device: offloading saves nothing there
            dev_params, dev_grads, dev_opt = 4 * lora_p, 4 * lora_own, 8 * lora_own
    grads_on_device = not s.offload or s.device_is_cpu
    # LoRA on more than one rank: the adapters' gradient bucket (engine/replicated.py `pending`, fp32, all adapters)
    # is allocated at the first adapter gradient, in the last unit's backward of a step's first micro-step, and
    # lives until the end of its last micro-step's backward: through the forward of every later micro-step too.
    bucket = 4 * lora_bucket if s.world > 1 else 0
    if s.world > step.W:  # hybrid: a trainable table's row gradients pend for the replica all-reduce the same way
        bucket += 4 * step.vocab_train
    # The head's weight gradient, held from the loss to the root's reduction; vocab-parallel: the local rows' (fp32
    # in the segment's .grad, accumulated by autograd), part of the sharded grads from then on.
    head_grad = (step.vocab_rows * d.hidden * step.c if step.vocab_train else 0) if step.vp else \
        (d.vocab * d.hidden * step.c if root.trainable is not None else 0)
    static = {"params": dev_params, "optimizer": dev_opt, "buffers": stats.buffer_bytes() + step.tile_buf}
    return ModelStates(static=static, grads=dev_grads, grads_prev=grads_prev, head_grad=head_grad,
                       root_grad=4 * root.trainable.shard_numel if root.trainable is not None and not s.offload else 0,
                       unit_grads=[4 * u.trainable.shard_numel if u.trainable and grads_on_device else 0
                                   for u in step.blocks],
                       bucket=bucket, bucket_prev=bucket if s.grad_accum > 1 and s.backend != "torch" else 0,
                       host_per_rank=host_per_rank, lora_params=lora_p, lora_own=lora_own, lora_bucket=lora_bucket)


@dataclass(frozen=True, kw_only=True)
class Activations:
    """What the forward saves for backward, per decoder unit and in all."""

    per_layer: int  # one unit's full set (activation_bytes_per_layer)
    ckpt: list[bool]  # each unit checkpointed (keeps only its input)
    saved: list[int]  # each unit's saved bytes on the device at the end of forward
    offloaded: bool  # the checkpointed inputs go to the host (engine/offload_activations.py)
    bsh: int  # one unit input's bytes
    total: int  # every unit's saved bytes and the root's (final norm, rotary tables, ids)
    root_backward: int  # the root's saved bytes left during a unit's backward
    host: int  # the checkpointed inputs' pinned host buffers, when offloaded

    def fetched(self, i: int) -> int:
        """Offloaded inputs on the device during unit i's backward: its own and the AHEAD earlier ones."""
        return self.bsh * sum(self.ckpt[j] for j in range(max(0, i - AHEAD), i + 1)) if self.offloaded else 0


def saved_activations(stats: ModelStats, s: Setup, step: StepFacts) -> Activations:
    d, bsh, ck = stats.dims, step.bsh, s.checkpointing
    per_layer = activation_bytes_per_layer(stats, s) + nf4_saved_scalers(step.blocks, step.c, s)
    every = 0 if ck is False else (1 if ck is True else int(ck))
    # Checkpointed: units 0, k, 2k, ... (engine/checkpointing.py)
    ckpt = [bool(every) and i % every == 0 for i in range(len(step.blocks))]
    off = s.offload_activations and bool(every)
    saved = [(0 if off else bsh) if c_ else per_layer for c_ in ckpt]  # a checkpointed unit keeps only its input
    root = root_activation_bytes(stats, s)
    # In a unit's backward the final norm's saved tensors are gone (its backward ran first): rotary tables, ids.
    return Activations(per_layer=per_layer, ckpt=ckpt, saved=saved, offloaded=off, bsh=bsh, total=sum(saved) + root,
                       root_backward=root - step.tokens * d.hidden * (4 + 2 * step.c),
                       host=sum(ckpt) * pinned_bytes(bsh, s) if off else 0)


@dataclass(frozen=True, kw_only=True)
class Gathered:
    """Unsharded unit buffers alive across the step, and the offload copies beside them."""

    root_held: int  # the root's buffer(s), gathered from before unit 0 to the end of backward
    forward: int  # held at the end of forward: the root and the last unit, or (no reshard after forward) every unit
    backward: int  # held in a unit's backward: the root, that unit and the one prefetched
    offload_copy: int  # cpu_offload: the H2D copies of shards alive at any time
    emb_prefetch: int = 0  # FSDP2: the embedding's unit, freed after forward, gathered again in unit 0's backward


def forward_gathered(stats: ModelStats, s: Setup, step: StepFacts) -> Gathered:
    d, unit_g = stats.dims, step.block_gathered
    big = max(unit_g, default=0)
    if s.split_tables and step.W > 1 and not stats.tied_tables():
        # FSDP2 (torch_backend.table_units): the embedding is its own unit, freed after its forward (full_shard);
        # the head's unit stays gathered like the root, so the root's held buffer is one V x H table smaller
        emb_table = d.vocab * d.hidden * step.c if s.strategy != "shard_grad_op" else 0
        root_held = step.root_gathered - emb_table
    else:
        root_held, emb_table = step.root_gathered, 0
    keeps_units = s.keeps_units
    held_fwd = root_held + (sum(unit_g) if keeps_units else (unit_g[-1] if unit_g else 0))
    prefetch_g = big if s.prefetch and not keeps_units else 0
    offload_copy = 0
    # FSDP2 copies each parameter's shard in, casts it, and copies the cast into its all-gather buffer before the unit
    # computes: nothing of it is alive at a compute peak (`plan --simulate`: 70B LoRA 4x24 read 0.937 with it counted)
    if s.offload and not s.device_is_cpu and s.backend != "torch":
        # The H2D copy of a decoder unit's shards before its all-gather: the prefetched unit's. A unit waits for its
        # own gather (dropping its copy) before it prefetches the next (engine/unit.py), so one copy is alive at a
        # time. Not the root's: it is gathered once, before unit 0, and stays gathered until the end of backward
        # (Gathered.backward), so its copy is never alive at a peak.
        # A shard group of one: the copy goes into the gathered buffer and is freed at once (unit.py unshard).
        offload_copy = max((f.shard_bytes() for u in step.blocks for f in u.flats), default=0) if step.W > 1 else 0
        # Row-sharded tables: their rows copied to the device once the root is unsharded, kept until it is
        # resharded (engine/flat_param.py stage_rows): from the first forward to the end of backward.
        offload_copy += sum(f.shard_bytes() for f in step.root.vocab)
    # FSDP2 prefetches, in unit 0's backward, the unit before it in forward order: the embedding's, even when it
    # takes no gradient (a frozen table: plan --simulate, 70B QLoRA 4x24 on FSDP2, peaked there at 1.058 of the plan)
    return Gathered(root_held=root_held, forward=held_fwd,
                    backward=held_fwd if keeps_units else root_held + big + prefetch_g, offload_copy=offload_copy,
                    emb_prefetch=emb_table if s.prefetch and not keeps_units else 0)


def loss_phases(stats: ModelStats, s: Setup, step: StepFacts, states: ModelStates, acts: Activations,
                held: Gathered) -> dict[str, dict[str, int]]:
    """The end of forward (the loss computed) and the loss's backward: every activation saved, the units gathered
    at the end of forward, the loss's transient on top (loss_bytes)."""
    head_trains = (step.root.trainable is not None and not step.vp) or bool(step.vocab_train)
    ce_fwd, ce_bwd = loss_bytes(stats, s, head_trains, step.vocab_rows)
    alive = {**states.static, "grads": states.grads_prev + states.bucket_prev,
             "gathered": held.forward + held.offload_copy}
    return {"forward-loss": {**alive, "activations": acts.total + ce_fwd},
            "loss-backward": {**alive, "activations": acts.total + ce_bwd},
            "norm-backward": {**alive, "activations": acts.total + final_norm_backward_bytes(stats, s)}}


def final_norm_backward_bytes(stats: ModelStats, s: Setup) -> int:
    """The final RMSNorm's backward, beyond its saved tensors (root_activation_bytes): HF's norm computes in fp32
    over the whole sequence, and its backward holds five fp32 b·s·h temporaries at once (the gradients through the
    upcast, the rsqrt product and the mean, and pow's 2·x) while its two compute-dtype tensors (the normalised
    input and the output the head read) are already freed: the peak of long-context recipes (bench/RESULTS.md
    stop 54)."""
    bs = s.micro_batch * s.local_seq
    return bs * stats.dims.hidden * (5 * 4 - 2 * _size(s.compute))


def in_flight_bytes(step: StepFacts, i: int) -> int:
    """Unit i's reduction still in flight (engine/reduce.py, one at a time) during unit i-1's backward (retired
    before its gradient cat): its gradient in reduce_dtype (the output is counted with the sharded grads). Without a
    shard group (W=1, no_shard) the gradient is its own output: nothing extra."""
    t = step.blocks[i].trainable if 0 <= i < len(step.blocks) and step.W > 1 else None
    return t.padded_numel * step.r if t is not None else 0


def unit_backward_phase(stats: ModelStats, s: Setup, step: StepFacts, states: ModelStates, acts: Activations,
                        held: Gathered) -> dict[str, int]:
    """The worst unit's backward, inside its MLP backward: the activations saved by units 0..i-1, unit i's own set
    (saved, or recomputed on top of its saved input), the sharded grads of every later unit. Without checkpointing
    the last unit is the worst (all activations alive); with it the earliest can be (little was saved, the grads of
    all later units exist: measured at the first unit's recompute, every-1 checkpointing). For the last unit,
    measured: the peak inside its MLP backward, with every activation still saved, the down-projection's weight
    grad and two b·s·i grads (of act·up and of act / up) alive, the head's weight grad held, the previous unit
    prefetched."""
    d, c, bsh = stats.dims, step.c, step.bsh
    bsi = min(step.tokens, s.mlp_chunk or step.tokens) * d.intermediate * c
    mlp_w_grad = d.mlp_weight_numel * c if not s.lora else 0
    # A MoE layer's backward (and recompute) holds the un-permute's rows on top of its saved set (plan/moe.py)
    unpermute = unpermute_bytes(d.moe, d.hidden, step.tokens, c) if d.moe else 0
    transient = max(2 * bsi, unpermute, adapter_sum_bytes(stats, s))
    # NF4: the MLP backward dequantizes each weight for its input gradient. down_proj's runs before the two b·s·i
    # gradients exist, gate/up's while one of them is being consumed: measured, the peak is the larger of the two
    # b·s·i grads and the dequantization transient, not their sum (QLoRA table of tests/plan_accuracy.py).
    nf4_extra = max(0, step.dequant - 2 * bsi)
    overlap = s.backward_schedule == "overlap"
    held_grad = bsh if s.recomputes and not d.moe else 0  # Setup.recomputes
    units = []
    for i in range(len(step.blocks)):
        # A recomputed fp32 unit's first norm saves the unit input itself (bf16 saves an upcast copy): counted once.
        own = acts.saved[i] + (acts.per_layer - (bsh if c == 4 else 0) + held_grad if acts.ckpt[i] else 0) \
            + acts.fetched(i)
        # engine/unit.py's schedules. Staggered: unit 1's reduction is retired before unit 0's backward; in any
        # other unit's MLP backward (its first half) the next unit's reduction is in flight and the previous unit
        # is gathered ahead only after it is retired (no reduction in flight: at once). Overlap (FSDP2's): the next
        # unit's reduction is in flight and the previous unit gathered during the whole backward of every unit.
        flight = in_flight_bytes(step, i + 1) if i or overlap else 0
        if s.keeps_units:
            gathered = held.forward
        else:
            ahead = i and s.prefetch and (overlap or not flight)
            gathered = held.root_held + step.block_gathered[i] + (step.block_gathered[i - 1] if ahead else
                                                                  held.emb_prefetch if i == 0 else 0)
        units.append({**states.static, "grads": max(states.grads_prev, sum(states.unit_grads[i + 1:]))
                      + states.head_grad + mlp_w_grad + states.bucket + flight,
                      "gathered": gathered + held.offload_copy + nf4_extra,
                      "activations": sum(acts.saved[:i]) + own + acts.root_backward + bsh + transient})
    return max(units, key=lambda ph: sum(ph.values()),
               default={**states.static, "grads": 0, "gathered": 0, "activations": 0})


def handoff_bytes(u: UnitLayout, s: Setup, step: StepFacts) -> tuple[int, int]:
    """A unit's gradient hand-off (engine/unit.py _post_backward): (grad bytes while autograd concatenates the
    per-param grads into the flat grad, unit still gathered; grad bytes while reducing, after the unit's gathered
    buffer is freed: the flat grad and its cast to reduce_dtype, then the cast and the 1D P/W output)."""
    if u.trainable is None:
        return 0, 0
    p, c, r = u.trainable.padded_numel, step.c, step.r
    cast = p * r if s.reduce != s.compute else 0
    out = p // step.W * r if step.W > 1 else 0
    return 2 * p * c, max(p * c + cast, (cast or p * c) + out)


def reduction_phases(stats: ModelStats, s: Setup, step: StepFacts, states: ModelStates, acts: Activations,
                     held: Gathered) -> dict[str, dict[str, int]]:
    """The gradient hand-off of the last decoder unit (its end measured at the start's level plus the flat grad
    less the unit's activations) and of the root at the very end of backward (every other unit's grads sharded):
    the per-param grads concatenated (gradcat), then cast and reduce-scattered (reduce). The engine frees a unit's
    gathered buffer at its last parameter grad, before autograd cats the flat grad (engine/unit.py _on_param_grad):
    the cat and the reduce run without it (unless aliased at W=1). Overlap: every other unit's gradient cat runs
    with the next unit's reduction still in flight."""
    L, unit_g = len(step.blocks), step.block_gathered
    last_cat, last_red = handoff_bytes(step.blocks[-1], s, step) if step.blocks else (0, 0)
    root_cat, root_red = handoff_bytes(step.root, s, step)
    aliased_units = step.aliased and s.compute == DTYPES[stats.recipe.model.dtype] and not s.lora
    last_ckpt = bool(acts.ckpt) and acts.ckpt[-1]
    # the last unit's full set, recomputed during its backward (and its incoming gradient: Setup.recomputes)
    recompute = acts.per_layer + (acts.bsh if s.recomputes and not stats.dims.moe else 0) if last_ckpt else 0
    after_last_grad = {"gathered": held.backward - (unit_g[-1] if unit_g and not aliased_units else 0)
                       + held.offload_copy,
                       "activations": acts.total + recompute + acts.bsh - (acts.bsh if last_ckpt else acts.per_layer)
                       + acts.fetched(L - 1)}
    overlap = s.backward_schedule == "overlap"
    in_flight = max((in_flight_bytes(step, i) for i in range(1, L)), default=0) if overlap else 0
    grads_last = states.grads_prev + states.head_grad + states.bucket  # beside the last unit's hand-off
    grads_root = max(states.grads_prev, states.grads - states.root_grad)  # beside the root's
    return {"unit-gradcat": {**states.static, "grads": grads_last + last_cat + in_flight, **after_last_grad},
            "unit-reduce": {**states.static, "grads": grads_last + last_red, **after_last_grad},
            "root-gradcat": {**states.static, "grads": grads_root + root_cat,
                             "gathered": (step.root_gathered if aliased_units else 0) + held.offload_copy,
                             "activations": 0},
            "root-reduce": {**states.static, "grads": grads_root + root_red, "gathered": held.offload_copy,
                            "activations": 0}}


def optimizer_phase(s: Setup, step: StepFacts, states: ModelStates) -> dict[str, int]:
    """AdamW's step: the sharded grads, and its temporaries. Host states (a CPU run; offload steps on the host too)
    use the fused CPU kernel (train.build_optimizer): in place, no temporaries. CUDA (foreach): one sqrt per
    segment, all at once."""
    segs = []
    for decay in (True, False):  # optimizer order: decay group, then no-decay, units in forward order, root last
        for t in [*(u.trainable for u in step.units), *(f for f in step.root.vocab if f.requires_grad)]:
            if t is not None:
                n = t.decay_numel if decay else t.numel - t.decay_numel
                if n:
                    segs.append(4 * min(n, t.shard_numel))
    segs += [4 * states.lora_own] if states.lora_own else []
    temp = 0 if s.device_is_cpu else sum(segs)
    # Sharded adapter states: after the step, this rank's run (M) and the all-gathered bucket (W·M), fp32
    regather = 4 * (states.lora_bucket + states.lora_own) if (s.shard_adapter_states and s.world > 1
                                                               and states.lora_params) else 0
    on_device = not s.offload or s.device_is_cpu
    return {**states.static, "grads": states.grads, "gathered": max(temp, regather) if on_device else regather,
            "activations": 0}


def fsdp2_offload_gather_phase(s: Setup, step: StepFacts, states: ModelStates, acts: Activations,
                               held: Gathered) -> dict[str, int]:
    """FSDP2 under cpu_offload, the backward prefetch of unit i-1 as unit i's backward starts: every parameter's shard
    of unit i-1 is copied to the device (and cast to the compute dtype) before the all-gather's output buffer is
    allocated, with unit i gathered and nothing of unit i recomputed yet. Its copies are gone before unit i computes
    (unit-backward does not count them). A MoE unit is mostly weights: its copies outweigh a recompute
    (`plan --simulate`, Qwen3-30B-A3B LoRA 2x24 on FSDP2: the peak is here)."""
    g = step.block_gathered
    worst: dict[str, int] = {}
    for i in range(1, len(step.blocks)):
        copies = sum(f.shard_numel for f in step.blocks[i - 1].flats) * step.c
        phase = {**states.static, "grads": max(states.grads_prev, sum(states.unit_grads[i + 1:])) + states.head_grad,
                 "gathered": held.root_held + g[i] + g[i - 1] + copies,
                 "activations": sum(acts.saved[:i + 1]) + acts.fetched(i) + acts.root_backward + step.bsh}
        worst = max(worst, phase, key=lambda ph: sum(ph.values()))
    return worst


def fsdp2_load_phase(s: Setup, step: StepFacts, states: ModelStates) -> dict[str, int]:
    """QLoRA on FSDP2's setup (trainer/parallelize.py, engine.backend=torch): torchao's NF4Tensor parameters are
    quantized whole before fully_shard, so each unit's NF4 weights are made whole just before FSDP2 shards that unit
    (engine/fsdp2_init.py quantized_weights_maker), one weight at a time, in chunks: at worst the shards kept plus
    the largest unit's NF4 weights whole. (It was the whole model in the model's dtype: 263 GiB at 70B.)"""
    whole_unit = max((sum(f.padded_numel for f in u.flats if f.dtype == torch.uint8) for u in step.units), default=0)
    return {"params": states.static["params"], "gathered": whole_unit, "buffers": states.static.get("buffers", 0)}


def estimate(stats: ModelStats, s: Setup) -> Estimate:
    """The step's phases (the module docstring), from what they share: the units and sizes, the model states, the
    saved activations and the gathered buffers. The peak is the largest phase."""
    sampled = grpo.is_grpo(stats)
    recipe_s, s = s, grpo.training_setup(stats, s) if sampled else s  # GRPO trains on prompt + completion rows
    step = step_facts(stats, s)
    states = model_states(stats, s, step)
    acts = saved_activations(stats, s, step)
    held = forward_gathered(stats, s, step)
    phases = {**loss_phases(stats, s, step, states, acts, held),
              "unit-backward": unit_backward_phase(stats, s, step, states, acts, held),
              **reduction_phases(stats, s, step, states, acts, held),
              "optimizer": optimizer_phase(s, step, states)}
    if s.backend == "torch" and s.offload and not s.device_is_cpu and len(step.blocks) > 1:
        phases["unit-gather"] = fsdp2_offload_gather_phase(s, step, states, acts, held)
    if s.backend == "torch" and s.nf4:
        phases["load"] = fsdp2_load_phase(s, step, states)
    if sampled:  # plan/grpo.py: the rollouts beside every phase, the log-probs' forward, generation
        phases = grpo.grpo_phases(stats, recipe_s, s, step, states, phases)
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak = max(totals, key=totals.__getitem__)  # the first phase on a tie
    per_rank = {f"{k}_bytes": phases[peak].get(k, 0) for k in CATEGORIES}
    per_rank["total_bytes"] = totals[peak]
    host_per_rank = states.host_per_rank + acts.host
    if sampled and s.offload:  # GRPO's frozen reference copy (full fine-tuning, beta > 0): offloaded like the policy
        host_per_rank += grpo.frozen_copy_bytes(stats, s, step)
    return Estimate(per_rank=per_rank, peak_phase=peak, phases=totals, breakdown=phases,
                    host_bytes=host_per_rank * max(1, s.world // s.nodes), host_per_rank=host_per_rank,
                    units=step.units, trainable_params=states.lora_params if s.lora else stats.num_params,
                    lora_params=states.lora_params)
