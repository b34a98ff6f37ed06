"""A torch-free upper bound on plan's per-rank peak, from config.json alone: the launcher's fast path.

The full plan needs torch (meta tensors, the engine's layout): ~2.5 s of CPU in the launcher before any worker
starts, on 2 cores ~2 s more time to the first step. When even this bound is under half of what is usable, the plan
cannot say "does not fit", so the pre-flight skips it; near or over capacity (and for `--fit`) the plan runs.

Bound, per rank, as if nothing were sharded and everything fp32 (tests/unit/plan/test_bound.py checks bound >= the
plan's peak over recipes x strategies x precisions x LoRA x checkpointing x micro-batches):
  states       32 B/param: master 4 + grad 4 + AdamW 8, and 16 for gathered copies, flat-grad concatenation and
               optimizer temporaries; parameters counted with every bias and untied embeddings
  activations  per layer 4·b·s·(12·h + 6·q + 10·i) + b·s²·(8·heads + 4) (eager only: softmax, mask) + b·heads·s·4
               (lse), every layer kept (no checkpointing credit); logits 6 fp32 copies of b·s·V; the root's
               norms and ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.schema import Recipe
from shardtune.plan.arch import config_namespace, read_config_json, supported


@dataclass(frozen=True)
class Bound:
    device_bytes: int  # per rank
    host_bytes: int  # per node, were every rank's states offloaded and unsharded


def param_upper_bound(c) -> int:
    q, kv, h, i = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, \
        c.intermediate_size
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + (q + 2 * kv + h)  # + every bias
    return 2 * c.vocab_size * h + c.num_hidden_layers * per_layer + h


def peak_upper_bound(recipe: Recipe, *, ranks_per_node: int) -> Bound | None:
    """None when config.json cannot be read here or is not an architecture we know (then the plan decides)."""
    raw = read_config_json(recipe.model)
    if raw is None or not supported(raw):
        return None
    c = config_namespace(raw)
    b, s = recipe.train.micro_batch_size * (2 if recipe.train.objective == "dpo" else 1), recipe.data.seq_len
    h, q, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size
    states = 32 * param_upper_bound(c)
    # s² terms only for eager attention (softmax, mask): sdpa runs per document with no mask (model/attention.py)
    squares = b * s * s * (8 * c.num_attention_heads + 4) if recipe.model.attn_implementation == "eager" else 0
    layer = 4 * b * s * (12 * h + 6 * q + 10 * i) + squares + b * c.num_attention_heads * s * 4
    logits = 6 * 4 * b * s * c.vocab_size
    root = 16 * b * s * h + 16 * b * s
    return Bound(device_bytes=states + c.num_hidden_layers * layer + logits + root,
                 host_bytes=states * ranks_per_node)
