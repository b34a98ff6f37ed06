"""The recipe schema: typed dataclasses, validated once. Nothing below this layer sees OmegaConf.

Each field's docstring-style comment is the help text. `__post_init__` checks values that types cannot
(ranges, conflicts) and raises ValueError naming the dotted key; `load.py` turns it into a UserError.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from shardtune.config.data_keys import check_data_config
from shardtune.errors import UserError


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")


@dataclass(kw_only=True)
class ModelConfig:
    config: str | None = None  # HF config.json (architecture only); used with init=random
    path: str | None = None  # local HF checkpoint dir (config + safetensors [+ tokenizer])
    tokenizer: str | None = None  # local tokenizer dir/file; default: model.path
    init: str = "random"  # random | pretrained
    # fp32 | bf16: dtype the weights are built (and, for a frozen base, stored) in. The engine's master weights,
    # gradients and AdamW state take the trainable parameters' dtype, so bf16 is only for LoRA (frozen bf16 base,
    # fp32 adapters); full fine-tuning in bf16 is an error: use fp32 + engine.mixed_precision=bf16 (bf16 compute).
    dtype: str = "fp32"
    attn_implementation: str = "sdpa"  # sdpa | eager
    # data.format=chat: a bundled chat template (chatml, plain) or a Jinja string; null = the tokenizer's own.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        _check(self.init in ("random", "pretrained"), "model.init", f"must be random or pretrained, got {self.init!r}")
        _check(self.dtype in ("fp32", "bf16"), "model.dtype", f"must be fp32 or bf16, got {self.dtype!r}")
        _check(self.attn_implementation in ("sdpa", "eager"), "model.attn_implementation",
               f"must be sdpa or eager, got {self.attn_implementation!r}")
        if self.chat_template is not None:
            from shardtune.templates import chat_template_source

            try:
                chat_template_source(self.chat_template)
            except ValueError as e:
                raise ValueError(f"model.chat_template: {e}") from None


@dataclass(kw_only=True)
class LoraConfig:
    enabled: bool = False  # inject LoRA adapters (replicated) over a frozen, sharded base
    r: int = 16  # adapter rank: memory and capacity grow with it
    alpha: int = 32  # scale = alpha / r
    dropout: float = 0.0  # dropout on the adapters' input during training
    # module names that get adapters (Linear modules by their last name part); `experts` = every fused expert weight
    # of a mixture of experts (per expert); auto = q_proj, v_proj, plus the experts when the model has them
    target_modules: list[str] = field(default_factory=lambda: ["auto"])
    # nf4 = QLoRA: the frozen Linear weights of the decoder blocks (LoRA-targeted or not) are stored, sharded and
    # all-gathered in 4-bit NF4 (~0.52 B/weight vs 2: ~3.9x less base memory and all-gather traffic), dequantized
    # per matmul (+1 bf16 weight temporary, ~+10-30% step time); embeddings, norms and lm_head stay in
    # engine.mixed_precision. null = the base in engine.mixed_precision.
    quantize_base: str | None = None

    def __post_init__(self) -> None:
        _check(self.r >= 1, "lora.r", f"must be >= 1, got {self.r}")
        _check(self.quantize_base in (None, "nf4"), "lora.quantize_base",
               f"must be nf4 or null, got {self.quantize_base!r}")
        _check(0.0 <= self.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(len(self.target_modules) > 0, "lora.target_modules", "must name at least one module")


@dataclass(kw_only=True)
class EngineConfig:
    backend: str = "shardtune"  # shardtune (our engine) | torch (PyTorch FSDP2 fully_shard, the A/B reference)
    strategy: str = "full_shard"  # full_shard | shard_grad_op | no_shard | hybrid_shard
    hybrid_shard_size: int | None = None  # ranks per shard group for hybrid_shard (default: one node)
    wrap: Any = "auto"  # auto = the model's decoder-block class (_no_split_modules), or a list of class names
    mixed_precision: str = "fp32"  # bf16 = bf16 compute/all-gather, fp32 master weights + optimizer
    reduce_dtype: str = "fp32"  # dtype of gradient reduce-scatter/all-reduce: fp32 | bf16
    activation_checkpointing: Any = False  # true = every unit, int k = every k-th unit: -activations, +~30% compute
    cpu_offload: bool = False  # sharded params, grads and optimizer state live on the host
    prefetch: bool = True  # overlap the next unit's all-gather with this unit's compute
    sync_every_microstep: bool = True  # false: reduce grads only on the last micro-step (more memory, less traffic)
    # overlap (FSDP2's: the previous unit gathered at once, +1 unit of backward memory) | staggered (a reduction
    # then the gather, each over half a unit: lower peak) | auto = overlap on a GPU, staggered on CPU
    backward_schedule: str = "auto"
    # QLoRA: an NF4 weight's matmuls dequantize tiles of output rows of at most this many MB (compute dtype) into a
    # reused buffer, forward and backward, instead of the whole weight (+~14 B/weight of torchao temporaries).
    # 0 = off: torchao's whole-weight linear_nf4.
    nf4_tile_mb: float = 64.0
    # The embedding and lm_head sharded by vocabulary rows and never all-gather (engine/vocab.py): saves the
    # gathered root's two V x H tables. Sharded strategies with more than one rank in the shard group (FSDP2: the
    # embedding and head become units of their own); false: the tables live in the root unit, gathered with it.
    vocab_parallel: bool = True
    # LoRA on our backend (ZeRO-2 for the adapters): each rank keeps the gradient and AdamW state of 1/W of the
    # adapters (reduce-scatter, step, all-gather: the all-reduce's bytes); the adapters' values stay whole on every
    # rank. -12·N·(W-1)/W bytes per rank for N adapter params. false: every rank steps every adapter (all-reduce).
    shard_adapter_states: bool = True
    # The inputs activation checkpointing keeps go to pinned host memory during forward and come back ahead of each
    # unit's recompute (engine/offload_activations.py): -b·s·h per checkpointed unit on the device, the same bytes
    # on the host and twice over PCIe (overlapped). Needs engine.activation_checkpointing.
    offload_activations: bool = False
    # Each decoder block's MLP runs over chunks of this many tokens of the micro-batch (model/tiled_mlp.py): its b·s·i
    # intermediates exist one chunk at a time, for one more MLP forward per step. The block's RMSNorms and LoRA
    # adapter branches (dropout 0) run chunked too: no fp32 copy of a whole b·s·h input. 0 = off (whole sequence).
    mlp_chunk_tokens: int = 0
    # Context parallelism (model/context_parallel.py): the ranks of each shard group split every row's sequence,
    # 1/N each, and all-gather the keys and values before each attention: activations /N per rank, for the same
    # global batch read by N ranks. Our backend, SFT, models without sliding-window attention.
    context_parallel: bool = False
    # Regional torch.compile: each decoder block's forward compiled once per run (fullgraph; rows of data.seq_len,
    # packed or padded; engine/compile.py), the engine's hooks outside it. Off: no GPU run has shown it faster yet,
    # and it costs the first step the compile time (seconds to minutes). Our backend; dense, (Q)LoRA, MoE.
    compile: bool = False

    def __post_init__(self) -> None:
        _check(self.backend in ("shardtune", "torch"), "engine.backend", f"must be shardtune or torch, got {self.backend!r}")
        _check(self.backward_schedule in ("auto", "overlap", "staggered"), "engine.backward_schedule",
               f"must be auto, overlap or staggered, got {self.backward_schedule!r}")
        _check(self.strategy in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard"), "engine.strategy",
               f"must be full_shard, shard_grad_op, no_shard or hybrid_shard, got {self.strategy!r}")
        _check(self.mixed_precision in ("fp32", "bf16"), "engine.mixed_precision",
               f"must be fp32 or bf16, got {self.mixed_precision!r}")
        _check(self.reduce_dtype in ("fp32", "bf16"), "engine.reduce_dtype", f"must be fp32 or bf16, got {self.reduce_dtype!r}")
        ac = self.activation_checkpointing
        _check(isinstance(ac, (bool, int)) and (isinstance(ac, bool) or ac >= 1), "engine.activation_checkpointing",
               f"must be true, false or an integer k >= 1 (every k-th unit), got {ac!r}")
        _check(not self.offload_activations or ac is not False, "engine.offload_activations",
               "offloads what activation checkpointing keeps: set engine.activation_checkpointing=true too")
        _check(isinstance(self.mlp_chunk_tokens, int) and self.mlp_chunk_tokens >= 0, "engine.mlp_chunk_tokens",
               f"must be an integer >= 0 (0: off), got {self.mlp_chunk_tokens!r}")
        w = self.wrap
        _check(w == "auto" or (isinstance(w, (list, tuple)) and all(isinstance(x, str) for x in w)) or
               (isinstance(w, int) and not isinstance(w, bool) and w > 0),
               "engine.wrap", f"must be auto, a list of module class names, or a minimum unit size in params, got {w!r}")
        _check(self.nf4_tile_mb >= 0, "engine.nf4_tile_mb", f"must be >= 0 (0: off), got {self.nf4_tile_mb}")
        if self.hybrid_shard_size is not None:
            _check(self.hybrid_shard_size >= 1, "engine.hybrid_shard_size", f"must be >= 1, got {self.hybrid_shard_size}")


def _first_non_finite(value: Any, key: str) -> tuple[str, float] | None:
    """(key, value) of the first inf or NaN among the recipe's numbers: YAML and the command line spell them (inf,
    .nan, INFINITY) and most range checks let inf through (lr > 0), to fail later as an overflow or a NaN loss."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (key, value)
    if dataclasses.is_dataclass(value):
        items = [(f"{key}.{f.name}" if key else f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = [(f"{key}.{k}", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{key}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for name, v in items:
        found = _first_non_finite(v, name)
        if found:
            return found
    return None


def shard_group_size(recipe: Recipe, world_size: int, local_world_size: int | None = None) -> int:
    """Ranks in each shard group: the world; hybrid_shard's size (default: the ranks of a node); 1 for no_shard."""
    engine = recipe.engine
    if engine.strategy == "hybrid_shard":
        return engine.hybrid_shard_size or local_world_size or world_size
    return 1 if engine.strategy == "no_shard" else world_size


def data_parallel_size(recipe: Recipe, world_size: int, local_world_size: int | None = None) -> int:
    """Ranks that read different rows: the world, or its shard groups under engine.context_parallel (the ranks of
    a group share their rows). The global batch is micro_batch_size x grad_accum x this."""
    if not recipe.engine.context_parallel:
        return world_size
    return max(1, world_size // max(1, shard_group_size(recipe, world_size, local_world_size)))


def check_world(recipe: Recipe, world_size: int, local_world_size: int | None = None) -> None:
    """Sharding that cannot work on this world size is a user error, found before any model is built."""
    engine = recipe.engine
    shard = shard_group_size(recipe, world_size, local_world_size)
    if engine.strategy == "hybrid_shard":
        if shard > world_size or world_size % shard:
            raise UserError(f"engine.hybrid_shard_size={shard} does not divide the world size {world_size}: "
                            f"pick a divisor of {world_size}")
    if engine.context_parallel:
        _check_context_parallel(recipe, shard, world_size)
    if shard == 1 and engine.backend == "torch" and recipe.lora.enabled and recipe.lora.quantize_base == "nf4":
        # torch 2.13's FSDP2 builds a one-rank group's parameters from one all-gather input; torchao's NF4 has three
        raise UserError("lora.quantize_base=nf4 with engine.backend=torch needs a shard group of 2+ ranks (FSDP2 "
                        f"cannot unshard torchao's NF4 weights in a group of one; here {world_size} rank(s), "
                        f"engine.strategy={engine.strategy}): use engine.backend=shardtune, or full_shard on 2+ GPUs")


def context_parallel_refusal(recipe: Recipe) -> str | None:
    """What keeps engine.context_parallel from running this recipe's settings (the model's own: model/moe_checks.py),
    or None."""
    why = ("engine.backend=torch (FSDP2 here has no sequence split): use engine.backend=shardtune"
           if recipe.engine.backend == "torch" else
           "train.objective=dpo (a pair's log-probabilities are summed over the whole row): use train.objective=sft"
           if recipe.train.objective == "dpo" else
           "train.objective=grpo (a completion's log-probabilities are taken per whole row): use train.objective=sft"
           if recipe.train.objective == "grpo" else
           f"model.attn_implementation={recipe.model.attn_implementation} (the split attention is sdpa's): use sdpa"
           if recipe.model.attn_implementation != "sdpa" else None)
    return why and f"engine.context_parallel=true does not run with {why}, or set engine.context_parallel=false"


def _check_context_parallel(recipe: Recipe, shard: int, world_size: int) -> None:
    """engine.context_parallel splits sequences over the shard group (model/context_parallel.py)."""
    engine = recipe.engine
    refusal = context_parallel_refusal(recipe)
    if refusal:
        raise UserError(refusal)
    if shard == 1:
        warnings.warn(f"engine.context_parallel=true is ignored: the shard group has one rank ({world_size} rank(s), "
                      f"engine.strategy={engine.strategy}); each rank runs whole sequences", stacklevel=3)
        return
    if recipe.data.seq_len % shard:
        raise UserError(f"engine.context_parallel=true splits data.seq_len={recipe.data.seq_len} over the shard "
                        f"group's {shard} ranks: set data.seq_len to a multiple of {shard}")


@dataclass(kw_only=True)
class DataConfig:
    # A jsonl/json/parquet/txt/csv file or folder, a saved datasets dir, or builtin:NAME; or a list of datasets
    # [{path, weight, format, <field keys>...}] mixed by weight (unset keys of an entry come from data.*).
    path: Any = None
    # A Hub dataset id (OWNER/NAME[@REV]) or a saved DatasetDict: the split to train on
    split: str = "train"
    # A Hub dataset id whose card has several subsets (configs, e.g. openai/gsm8k's main and socratic): the one to read
    subset: str | None = None
    # text | instruction (prompt/response pairs, prompt masked) | chat (messages) | preference (rows
    # {prompt, chosen, rejected}, for train.objective=dpo)
    format: str = "text"
    text_field: str = "text"  # format=text: the column holding the document
    prompt_field: str = "prompt"  # format=instruction: the instruction column (Alpaca's `instruction` is found)
    input_field: str = "input"  # format=instruction: optional extra context (Alpaca's `input`), after the prompt
    response_field: str = "response"  # format=instruction: the answer column (Alpaca's `output` is found)
    # format=instruction, and preference's string prompts: plain | alpaca | chatml, or a string with {prompt} and
    # {input}
    template: str = "plain"
    messages_field: str = "messages"  # format=chat: the list of turns (ShareGPT's `conversations` is found)
    chat_style: str = "auto"  # format=chat: auto | openai ({role, content}) | sharegpt ({from, value})
    chosen_field: str = "chosen"  # format=preference: the preferred response column (strings or message lists)
    rejected_field: str = "rejected"  # format=preference: the dispreferred response column
    train_on_inputs: bool = False  # also take the loss on prompts / user turns (default: responses only)
    seq_len: int = 512  # tokens per sample after packing/padding
    packing: bool = True  # concatenate documents to seq_len (position ids reset per document); never for preference pairs
    # Documents longer than seq_len: truncate (keep the first seq_len tokens) | split (keep every token: seq_len
    # pieces, each starting at the previous piece's last token, which it reads as context but is not trained on
    # again; packed rows take a document's pieces in order). Preference pairs are always truncated (preference.py).
    long_docs: str = "truncate"
    eval_fraction: float = 0.05  # held-out share of the data for eval_loss
    num_samples: int = 2000  # size of a generated builtin:* dataset
    cache_dir: str | None = None  # tokenized Arrow cache, shared by ranks and runs (default: <output_dir>/data_cache)
    num_proc: int = 0  # tokenizer processes for the cache build (0: auto, one per core for large datasets)
    prepare_timeout_min: int = 120  # how long other ranks wait for rank 0's cache build before giving up

    def __post_init__(self) -> None:
        check_data_config(vars(self))
        _check(self.seq_len >= 8, "data.seq_len", f"must be >= 8, got {self.seq_len}")
        _check(self.long_docs in ("truncate", "split"), "data.long_docs",
               f"must be truncate or split, got {self.long_docs!r}")
        _check(self.long_docs == "truncate" or self.format != "preference", "data.long_docs",
               "split does not apply to preference pairs (each pair is one prompt and two responses, truncated as "
               "DPO needs): set data.long_docs=truncate")
        _check(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        _check(self.num_samples >= 1, "data.num_samples", f"must be >= 1, got {self.num_samples}")
        _check(self.num_proc >= 0, "data.num_proc", f"must be >= 0 (0: auto), got {self.num_proc}")
        _check(self.prepare_timeout_min >= 1, "data.prepare_timeout_min", f"must be >= 1, got {self.prepare_timeout_min}")


@dataclass(kw_only=True)
class TrainConfig:
    output_dir: str = "runs/run"  # the run directory (metrics, checkpoints, final model)
    micro_batch_size: int = 1  # samples per rank per forward pass
    grad_accum: int = 1  # micro-steps per optimizer step; global batch = micro_batch_size * world * grad_accum
    #   (engine.context_parallel: world / the shard group's size instead of world)
    max_steps: int | None = None  # optimizer steps (null with train.epochs; 100 when neither is set)
    epochs: float | None = None  # passes over the training rows instead of max_steps (exactly one of the two)
    lr: float = 2e-4  # peak learning rate (AdamW), reached after warmup_steps
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0  # steps of linear warmup from 0 to lr (must be < max_steps)
    weight_decay: float = 0.0  # AdamW decoupled decay; never applied to norms and biases
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # 0 disables clipping
    seed: int = 0  # seeds the random init, data shuffling and the data split
    eval_every: int = 0  # steps between eval_loss lines (0: only at the end when eval data exists)
    eval_batches: int = 4  # batches per eval
    save_every: int = 0  # steps between sharded checkpoints, plus one at the end (0: none)
    keep_last: int = 0  # complete checkpoints to keep (0: all)
    # auto = newest complete checkpoint in output_dir (refused when it was trained on other data: exit 2) |
    # force = the same, continued on this recipe's data/objective | none | a checkpoints/step_N path
    resume: str = "auto"
    skip_nonfinite: int = 0  # steps with a NaN/inf loss or grad norm to skip (then stop); 0: stop at the first
    # Steps between plain progress lines when stdout is not a terminal (log file, SLURM output); step 1, eval steps
    # and the last step are printed too: the 300-step demo prints 19 lines. On a terminal a live display updates
    # every step instead. metrics.jsonl always has every step.
    log_every: int = 20
    profile_memory: bool = False  # CPU: peak live tensor bytes; CUDA: max_memory_allocated
    # Where rank 0 logs the metrics.jsonl records besides: tensorboard | wandb | mlflow, a list or one name (wandb
    # and mlflow are extras: pip install 'shardtune[wandb]'); the recipe is the tracker run's config, and a resumed
    # run continues the same tracker run. [] = metrics.jsonl only.
    report_to: Any = field(default_factory=lambda: ["tensorboard"])
    demo_eval: bool = False  # held-out exact-match accuracy before and after (format=instruction; else skipped)
    demo_eval_samples: int = 64  # held-out prompts decoded by demo_eval
    save_final: bool = True  # write final/ (HF format, or a PEFT adapter with LoRA)
    # sft: next-token loss on the targets | dpo: preference pairs (data.format=preference; see the dpo section).
    # With dpo, micro_batch_size counts pairs: each forward runs 2 x micro_batch_size rows (chosen + rejected).
    # grpo: online RL on prompts (data.format=prompt; see the grpo section): micro_batch_size counts prompts, each
    # forward runs micro_batch_size x grpo.num_generations completions.
    objective: str = "sft"
    # Tokens per chunk of the fused head projection + cross-entropy (engine/loss.py): only C*V logits ever exist instead of
    # b*s*V (compute dtype + fp32 + fp32 gradient). 0 = off: full logits in one piece.
    loss_chunk_tokens: int = 1024
    # Mixtures of experts: weight of the routers' load-balancing loss (model/router_loss.py: per packed row, so data
    # parallelism stays exact), added to the SFT loss. 0 = off (the models' own config value is not used).
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        _check(self.objective in ("sft", "dpo", "grpo"), "train.objective",
               f"must be sft, dpo or grpo, got {self.objective!r}")
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        known = ("tensorboard", "wandb", "mlflow")
        _check(isinstance(self.report_to, (list, tuple)) and all(t in known for t in self.report_to),
               "train.report_to", f"must be a list of tensorboard, wandb, mlflow, got {self.report_to!r}")
        self.report_to = list(dict.fromkeys(self.report_to))
        _check(self.max_steps is None or self.epochs is None, "train.epochs",
               f"and train.max_steps are both set ({self.epochs} and {self.max_steps}): keep one, set the other to null")
        if self.epochs is None and self.max_steps is None:
            self.max_steps = 100
        if self.epochs is not None:
            _check(self.epochs > 0, "train.epochs", f"must be > 0, got {self.epochs}")
        if self.max_steps is not None:
            _check(self.max_steps >= 1, "train.max_steps", f"must be >= 1, got {self.max_steps}")
        for key in ("micro_batch_size", "grad_accum", "log_every", "eval_batches", "demo_eval_samples"):
            _check(getattr(self, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("warmup_steps", "eval_every", "save_every", "weight_decay", "max_grad_norm", "keep_last",
                    "skip_nonfinite", "loss_chunk_tokens", "router_aux_loss_coef"):
            _check(getattr(self, key) >= 0, f"train.{key}", f"must be >= 0, got {getattr(self, key)}")
        _check(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _check(self.eps >= 0, "train.eps", f"must be >= 0 (AdamW's epsilon), got {self.eps}")
        # torch takes any 64-bit seed; numpy's generators (the data split and shuffle) only non-negative ones
        _check(0 <= self.seed < 1 << 63, "train.seed", f"must be an integer in [0, 2**63), got {self.seed}")
        _check(self.schedule in ("cosine", "linear", "constant"), "train.schedule",
               f"must be cosine, linear or constant, got {self.schedule!r}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas",
               f"must be two numbers in [0, 1), got {self.betas}")


@dataclass(kw_only=True)
class DpoConfig:
    beta: float = 0.1  # how far the policy may move from the reference: smaller = further
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo (length-normalised, as TRL) | hinge (SLiC)
    label_smoothing: float = 0.0  # sigmoid only: probability a preference label is wrong (conservative DPO)
    # Where the reference log-probs come from. null (auto): LoRA = the same sharded base with the adapters off
    # (one extra no-grad forward per micro-step, no memory); full fine-tuning = precomputed. true: one no-grad pass
    # over every pair before step 1 with the initial weights (8 B per pair, saved in the run dir for resume; no
    # model copy, no extra forward during training). false with full fine-tuning is an error (no frozen copy).
    precompute_reference: bool | None = None
    # SFT on the chosen responses for the first N steps, then DPO with those weights as the reference (precomputed):
    # one run instead of an SFT run + a DPO run (the tiny-dpo-cpu demo). 0: start DPO from the model as loaded.
    sft_warmup_steps: int = 0

    def __post_init__(self) -> None:
        _check(self.beta > 0, "dpo.beta", f"must be > 0, got {self.beta}")
        _check(self.loss in ("sigmoid", "ipo", "hinge"), "dpo.loss", f"must be sigmoid, ipo or hinge, got {self.loss!r}")
        _check(0.0 <= self.label_smoothing < 0.5, "dpo.label_smoothing",
               f"must be in [0, 0.5), got {self.label_smoothing}")
        _check(self.label_smoothing == 0.0 or self.loss == "sigmoid", "dpo.label_smoothing",
               f"applies to dpo.loss=sigmoid only (got loss={self.loss}): set it to 0")
        _check(self.sft_warmup_steps >= 0, "dpo.sft_warmup_steps", f"must be >= 0, got {self.sft_warmup_steps}")
        _check(self.sft_warmup_steps == 0 or self.precompute_reference is not False, "dpo.precompute_reference",
               "false cannot follow an SFT warm-up (the reference is the warmed-up model): set it to null or true")


@dataclass(kw_only=True)
class GrpoConfig:
    num_generations: int = 4  # completions sampled per prompt (a group: advantages are relative to its mean)
    max_new_tokens: int = 64  # the longest completion (TRL's max_completion_length); stops earlier at EOS/turn end
    temperature: float = 1.0  # sampling temperature (also divides the logits of the trained log-probs, as TRL)
    top_p: float = 1.0  # nucleus sampling: keep the fewest tokens whose mass reaches top_p (1: off)
    top_k: int = 0  # keep the k most likely tokens (0: off)
    # grpo | dr_grpo | dapo | bnpo: how the token losses are averaged, as TRL's GRPOTrainer (dapo, its default: over
    # the step's completion tokens; grpo: per completion, then over completions; dr_grpo: over completions x
    # max_new_tokens; bnpo: over each micro-batch's tokens, so not exact across world sizes)
    loss_type: str = "dapo"
    epsilon: float = 0.2  # clip range of the probability ratio below 1 (and above, unless epsilon_high is set)
    epsilon_high: float | None = None  # the clip above 1 (DAPO's clip-higher, e.g. 0.28); null: epsilon
    # Weight of the k3 KL term to the reference (LoRA: the base with adapters off; full fine-tuning: a frozen sharded
    # copy of the starting weights, params / N more per rank). 0: no reference forward (TRL's default)
    beta: float = 0.0
    # Optimizer steps on each batch of generations (TRL's num_iterations): with more than 1 the sampling policy's
    # log-probs are kept and the ratio is clipped; the next prompts are sampled every num_iterations steps
    num_iterations: int = 1
    scale_rewards: str = "group"  # divide advantages by the std of the group | batch | none (as in Dr GRPO)
    # Reward functions, summed with reward_weights: exact_match[:COLUMN], numeric_match[:COLUMN], format:REGEX,
    # think_format, length_penalty:N, path/to/file.py:function or package.module:function (TRL's signature
    # fn(prompts, completions, **columns) -> list[float]); see trainer/rewards.py
    reward_funcs: list[str] = field(default_factory=lambda: ["exact_match"])
    reward_weights: list[float] | None = None  # one weight per reward function (null: 1 each)

    def __post_init__(self) -> None:
        LOSS_TYPES, SCALE_REWARDS = ("grpo", "dr_grpo", "dapo", "bnpo"), ("group", "batch", "none")  # grpo_loss.py's
        _check(self.num_generations >= 2, "grpo.num_generations",
               f"must be >= 2 (advantages compare the completions of a prompt), got {self.num_generations}")
        _check(self.max_new_tokens >= 1, "grpo.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.temperature > 0, "grpo.temperature", f"must be > 0 (GRPO samples), got {self.temperature}")
        _check(0 < self.top_p <= 1, "grpo.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "grpo.top_k", f"must be >= 0 (0: off), got {self.top_k}")
        _check(self.loss_type in LOSS_TYPES, "grpo.loss_type",
               f"must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        _check(0 <= self.epsilon < 1, "grpo.epsilon", f"must be in [0, 1), got {self.epsilon}")
        _check(self.epsilon_high is None or self.epsilon_high >= 0, "grpo.epsilon_high",
               f"must be >= 0 (or null: grpo.epsilon), got {self.epsilon_high}")
        _check(self.beta >= 0, "grpo.beta", f"must be >= 0, got {self.beta}")
        _check(self.num_iterations >= 1, "grpo.num_iterations", f"must be >= 1, got {self.num_iterations}")
        _check(self.scale_rewards in SCALE_REWARDS, "grpo.scale_rewards",
               f"must be one of {', '.join(SCALE_REWARDS)}, got {self.scale_rewards!r}")
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        _check(isinstance(self.reward_funcs, (list, tuple)) and len(self.reward_funcs) > 0
               and all(isinstance(f, str) and f for f in self.reward_funcs), "grpo.reward_funcs",
               f"must be a non-empty list of reward function names, got {self.reward_funcs!r}")
        self.reward_funcs = list(self.reward_funcs)
        if self.reward_weights is not None:
            _check(isinstance(self.reward_weights, (list, tuple)) and len(self.reward_weights) == len(self.reward_funcs)
                   and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.reward_weights),
                   "grpo.reward_weights", f"must be {len(self.reward_funcs)} numbers (one per grpo.reward_funcs "
                   f"entry) or null, got {self.reward_weights!r}")
            self.reward_weights = [float(w) for w in self.reward_weights]

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(kw_only=True)
class LaunchConfig:
    nproc_per_node: Any = "auto"  # auto = all GPUs, else 2 CPU workers
    nnodes: int = 1  # nodes in the job (each runs nproc_per_node workers)
    device: str = "auto"  # auto | cpu | cuda
    rdzv_endpoint: str | None = None  # host:port of the c10d rendezvous for multi-node (torchrun)
    node_rank: int | None = None  # this node's index in a multi-node job (torchrun --node-rank)
    # This node's address as the other nodes reach it (torchrun --local-addr). It matters with restarts on: each
    # attempt's store is then hosted on rank 0's node at this address (default: torchrun's socket.getfqdn(), which
    # some clusters do not resolve between nodes). Inside a SLURM step it is filled in from the node's NodeAddr.
    local_addr: str | None = None
    max_restarts: int = 0  # torchrun restarts a failed job this many times (it resumes from the latest checkpoint)
    threads_per_worker: int | None = None  # torch threads per worker (default: an exported OMP_NUM_THREADS, else
    #                                         cores / workers on CPU and under engine.cpu_offload; else torchrun's 1)

    def __post_init__(self) -> None:
        n = self.nproc_per_node
        _check(n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 1), "launch.nproc_per_node",
               f"must be auto or an integer >= 1, got {n!r}")
        _check(self.nnodes >= 1, "launch.nnodes", f"must be >= 1, got {self.nnodes}")
        _check(self.device in ("auto", "cpu", "cuda"), "launch.device", f"must be auto, cpu or cuda, got {self.device!r}")
        _check(self.max_restarts >= 0, "launch.max_restarts", f"must be >= 0, got {self.max_restarts}")

    def device_type(self) -> str:
        """cpu or cuda. torch is imported only to resolve `auto`: the launcher process stays light (a CPU launch
        starts its workers ~2 s sooner without it)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def is_first_node(self) -> bool:
        """This launcher runs on the job's first node (launch.node_rank, else SLURM's node index inside an srun
        step): where once-per-job lines are printed and the run directory's recipe history is written."""
        if self.node_rank is not None:
            return self.node_rank == 0
        import os

        return os.environ.get("SLURM_NODEID", "0") == "0"


@dataclass(kw_only=True)
class HardwareConfig:
    gpu: str = "rtx4090-24gb"  # a profile in configs/hardware/ (what plan checks against)
    num_gpus: int = 4  # GPUs of the job, all nodes together: plan's world size when launch.nproc_per_node is auto
    host_ram_gb: float | None = None  # host RAM per node for plan and pre-flight (default: detected)

    def __post_init__(self) -> None:
        _check(self.num_gpus >= 1, "hardware.num_gpus", f"must be >= 1, got {self.num_gpus}")


@dataclass(kw_only=True)
class Recipe:
    description: str = ""  # one line shown by `shardtune recipes`
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)  # used with train.objective=dpo
    grpo: GrpoConfig = field(default_factory=GrpoConfig)  # used with train.objective=grpo
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)

    def check(self) -> None:
        """Cross-section checks; run on the merged recipe (defaults alone may be incomplete)."""
        bad = _first_non_finite(self, "")
        if bad:
            raise ValueError(f"{bad[0]}: must be a finite number, got {bad[1]}")
        m = self.model
        if m.init == "pretrained":
            _check(m.path is not None, "model.path", "init=pretrained needs model.path=DIR (a local HF checkpoint)")
        else:
            _check(m.config is not None or m.path is not None, "model.config",
                   "init=random needs model.config=FILE.json (or model.path=DIR with a config.json)")
        # bf16 masters would lose every update smaller than bf16's resolution (~0.4% of the weight): AdamW steps at
        # lr 1e-5 vanish. Mixed precision gives the same bf16 compute and all-gather bytes with fp32 masters.
        _check(m.dtype == "fp32" or self.lora.enabled, "model.dtype",
               "bf16 with full fine-tuning would make master weights, gradients and AdamW state bf16: use "
               "model.dtype=fp32 with engine.mixed_precision=bf16 (bf16 compute, fp32 masters), or lora.enabled=true")
        _check(self.lora.quantize_base is None or self.lora.enabled, "lora.quantize_base",
               "quantizes the frozen base under LoRA only: set lora.enabled=true (or lora.quantize_base=null)")
        if self.engine.compile:  # what a compiled block cannot trace yet (engine/compile.py)
            _check(not self.engine.context_parallel, "engine.compile",
                   "context parallelism's collectives inside the attention are not compiled: set engine.compile=false")
            _check(not self.engine.mlp_chunk_tokens, "engine.compile",
                   "the MLP's chunk loop depends on the sequence length (a compile per length): set "
                   "engine.mlp_chunk_tokens=0 or engine.compile=false")
        dpo = self.train.objective == "dpo"
        _check(dpo == (self.data.format == "preference"), "train.objective" if dpo else "data.format",
               f"objective {self.train.objective} with data.format={self.data.format}: dpo trains on "
               "data.format=preference rows ({prompt, chosen, rejected}); set both or neither")
        _check(not dpo or self.lora.enabled or self.dpo.precompute_reference is not False, "dpo.precompute_reference",
               "false needs lora.enabled=true (the reference is the base with adapters off); full fine-tuning "
               "takes its reference log-probs precomputed: set it to true or null")
        grpo = self.train.objective == "grpo"
        _check(grpo == (self.data.format == "prompt"), "train.objective" if grpo else "data.format",
               f"objective {self.train.objective} with data.format={self.data.format}: grpo samples completions of "
               "data.format=prompt rows ({prompt, <reward columns>}); set both or neither")
        _check(not (grpo and self.train.demo_eval), "train.demo_eval",
               "decodes instruction rows; with train.objective=grpo set it to false (GRPO reports the held-out "
               "reward: eval_reward)")
        _check(not (dpo and self.train.demo_eval), "train.demo_eval",
               "decodes instruction rows; with train.objective=dpo set it to false (DPO reports held-out reward "
               "accuracy: eval_reward_accuracy)")
        _check(self.data.path is not None, "data.path",
               "not set: give a jsonl/json/parquet/txt file or folder, a saved dataset dir, or builtin:reverse")
