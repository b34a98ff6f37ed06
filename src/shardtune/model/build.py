"""Model and tokenizer through Hugging Face: random init from a config, or a local pretrained checkpoint."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from shardtune.config.dtypes import DTYPES
from shardtune.config.schema import ModelConfig
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.errors import UserError
from shardtune.hub import CONFIG, TOKENIZER, is_hub_id, model_dir
from shardtune.model.attention import attn_implementation
from shardtune.model.experts import expert_modules, use_grouped_experts
from shardtune.model.loading import build_empty, no_weights, weight_files
from shardtune.model.rms_norm import use_fused_rms_norm
from shardtune.model.rotary import use_fused_rotary
from shardtune.model.seeded_init import init_full
from shardtune.templates import resolve_chat_template


def load_config(cfg: ModelConfig) -> PretrainedConfig:
    source = cfg.config or (model_dir(cfg.path) if cfg.path else None)
    assert source is not None, "schema guarantees config or path"
    key = "model.config" if cfg.config else "model.path"
    try:  # never run a repo's own code (and never ask: transformers would prompt on a terminal)
        return AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        if _custom_code(e):
            raise UserError(_custom_code_error(key, source)) from None
        raise UserError(f"{key}: cannot read an HF config from '{source}' ({str(e).splitlines()[0][:120]}): "
                        "point it at a config.json or a checkpoint folder") from None


def _custom_code(e: Exception) -> bool:
    return "trust_remote_code" in str(e) or "custom code" in str(e)


def _custom_code_error(key: str, source: object) -> str:
    return (f"{key}: '{source}' needs its own Python code (an auto_map with trust_remote_code), which shardtune "
            "does not run: use a checkpoint of an architecture transformers ships (most repos that once needed "
            "custom code have a converted version)")


def config_source(cfg: ModelConfig) -> str:
    """The config a model is built from, as a message names it."""
    return f"model.config '{cfg.config}'" if cfg.config else "model.path's config.json"


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu",
                sharded_init: bool = False) -> PreTrainedModel:
    """Parameters on the meta device, buffers real, when `parallelize` fills them shard by shard: pretrained (each
    rank reads only its shard from the files) or `sharded_init` (each rank draws only its shard). Otherwise a full
    model on `device`. Random init is seeded per module (model/seeded_init.py): the same weights whether drawn whole here
    or shard by shard at any world size."""
    hf_config = load_config(cfg)
    dtype = DTYPES[cfg.dtype]
    # a hub id's weights are fetched by the trainer (hub.fetch_for_ranks), not by plan or validate
    if cfg.init == "pretrained" and not is_hub_id(cfg.path) and not weight_files(Path(cfg.path)):
        raise UserError(no_weights(cfg.path))
    model = build_empty(lambda: from_config(cfg, hf_config, dtype=dtype,
                                            attn=attn_implementation(cfg.attn_implementation)))
    if expert_modules(model):
        # Our grouped experts (model/experts.py) for every MoE run, not only LoRA on experts: transformers' own
        # calls torch's grouped kernel in any dtype, and on CUDA that kernel takes bf16 only (an fp32 run crashed)
        use_grouped_experts(model)
    use_fused_rms_norm(model)  # torch's fused rms_norm, transformers' arithmetic (model/rms_norm.py)
    use_fused_rotary(model)  # q and k rotated together in 6 kernels each way, transformers' arithmetic (model/rotary.py)
    if cfg.init == "pretrained" or sharded_init:
        return model
    init_full(model, seed=seed, dtype=dtype, device=device)
    return model.to(device)  # the buffers (parameters are there already)


def from_config(cfg: ModelConfig, hf_config: PretrainedConfig, *, dtype: torch.dtype,
                attn: str | None = None) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_config` (`attn`: the attention implementation, default model.attn_implementation).
    A config transformers cannot build from (an activation it does not know, a missing dimension) fails in the
    model's constructor: that is the config's fault, one line naming the value."""
    try:
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                attn_implementation=attn or cfg.attn_implementation)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError, NotImplementedError) as e:
        if isinstance(e, ValueError) and "attention implementation" in str(e):
            raise UserError(f"model.attn_implementation: {hf_config.model_type} has no "
                            f"'{attn or cfg.attn_implementation}' attention in transformers: set "
                            "model.attn_implementation=eager") from None
        key = "model.config" if cfg.config else "model.path"
        detail = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        named = [f"{k}={v!r}" for k, v in hf_config.to_dict().items()
                 if isinstance(e, KeyError) and e.args and isinstance(v, str) and v == e.args[0]]
        what = f"its {', '.join(named)} is unknown to transformers" if named else f"transformers failed ({detail})"
        raise UserError(f"{key}: cannot build a {getattr(hf_config, 'model_type', '?')} model from "
                        f"'{cfg.config or cfg.path}': {what}: fix that value in its config.json") from None


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    tok = _load_tokenizer(cfg)
    tok.chat_template = resolve_chat_template(tok.chat_template, cfg.chat_template)  # model.chat_template wins
    return tok


def _load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    source = cfg.tokenizer or (model_dir(cfg.path, CONFIG + TOKENIZER) if cfg.path else None)
    if source is None or source == "builtin:char":
        return build_char_tokenizer()
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if _custom_code(e):
            raise UserError(_custom_code_error("model.tokenizer", source)) from None
        raise UserError(f"model.tokenizer: cannot load a tokenizer from '{source}' ({str(e).splitlines()[0][:120]}): "
                        "point it at a local tokenizer folder or tokenizer.json, or use builtin:char") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    elif tok.pad_token is None:
        # Padding (eval batches, generation) needs an id; every use masks it out. Training needs no eos, but its
        # absence is worth a line: nothing marks where an answer ends.
        tok.pad_token = tok.unk_token or tok.convert_ids_to_tokens(0)
        warnings.warn(f"model.tokenizer: '{source}' has no eos_token: documents are packed without an end marker "
                      "and generated answers run to their max_new_tokens; add the model's eos_token to its "
                      "tokenizer_config.json if it has one", stacklevel=2)
    return tok


def check_vocab(tok: PreTrainedTokenizerBase, hf_config: PretrainedConfig, cfg: ModelConfig) -> None:
    """Every id the tokenizer can produce has an embedding row. A tokenizer paired with another model's config (a
    Llama-3 tokenizer, 128,256 ids, on a 32,000-row config) would otherwise train on garbage without an error: on the
    vocab-parallel table an id past the end matches no rank's rows and reads zeros."""
    rows = getattr(hf_config.get_text_config(), "vocab_size", None)
    if rows is not None and len(tok) > rows:
        key = "model.tokenizer" if cfg.tokenizer else "model.path"
        raise UserError(f"{key}: the tokenizer has {len(tok):,} tokens but the model's vocab_size is {rows:,}: ids "
                        f"from {rows:,} on have no embedding row; use the model's own tokenizer, or a config with "
                        f"vocab_size >= {len(tok):,}")
