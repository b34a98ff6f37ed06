"""A `plan --fit` candidate: its plan, its predicted step time, and the overrides that turn the recipe into it."""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.plan.result import Plan


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    time: dict[str, float]

    def overrides(self) -> str:
        s = self.plan.setup
        ck = "true" if s.checkpointing is True else ("false" if s.checkpointing is False else str(s.checkpointing))
        parts = [f"engine.strategy={s.strategy}", f"engine.activation_checkpointing={ck}",
                 f"engine.cpu_offload={'true' if s.offload else 'false'}", f"train.micro_batch_size={s.micro_batch}",
                 f"train.grad_accum={s.grad_accum}"]
        if s.lora != self.plan.recipe.lora.enabled:
            parts.append(f"lora.enabled={'true' if s.lora else 'false'}")
        if s.nf4 != (self.plan.recipe.lora.quantize_base == "nf4"):
            parts.append(f"lora.quantize_base={'nf4' if s.nf4 else 'null'}")
        if not s.device_is_cpu:
            parts.append(f"engine.backward_schedule={s.backward_schedule}")
        if s.loss_chunk != (self.plan.recipe.train.loss_chunk_tokens if self.plan.recipe.train.objective == "sft" else 0):
            parts.append(f"train.loss_chunk_tokens={s.loss_chunk}")
        if s.nf4 and s.nf4_tile_bytes and s.nf4_tile_bytes != int(self.plan.recipe.engine.nf4_tile_mb * (1 << 20)):
            parts.append(f"engine.nf4_tile_mb={s.nf4_tile_bytes / (1 << 20):g}")
        if s.vocab_parallel != (self.plan.recipe.engine.vocab_parallel and self.plan.recipe.engine.backend == "shardtune"):
            parts.append(f"engine.vocab_parallel={'true' if s.vocab_parallel else 'false'}")
        e = self.plan.recipe.engine
        if s.lora and s.shard_adapter_states != (e.shard_adapter_states and e.backend == "shardtune"):
            parts.append(f"engine.shard_adapter_states={'true' if s.shard_adapter_states else 'false'}")
        if s.offload_activations != e.offload_activations:
            parts.append(f"engine.offload_activations={'true' if s.offload_activations else 'false'}")
        if s.mlp_chunk != e.mlp_chunk_tokens:
            parts.append(f"engine.mlp_chunk_tokens={s.mlp_chunk}")
        if (s.context_parallel > 1) != e.context_parallel and (s.context_parallel > 1 or s.shard_size > 1):
            parts.append(f"engine.context_parallel={'true' if s.context_parallel > 1 else 'false'}")
        return " ".join(parts)
