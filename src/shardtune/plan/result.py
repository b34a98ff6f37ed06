"""A plan: a recipe's memory estimate against its hardware (fits, headroom, advice), and its variants."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from shardtune.config.schema import Recipe
from shardtune.plan.estimate import Estimate, Setup, estimate
from shardtune.plan.hardware import GiB, HardwareProfile, usable_gpu_bytes
from shardtune.plan.stats import ModelStats

MIN_HEADROOM = 0.03  # of usable memory: less fits on paper and runs out on some card, driver or allocator state


@dataclass
class Plan:
    recipe: Recipe
    stats: ModelStats
    setup: Setup
    estimate: Estimate
    hardware: HardwareProfile
    advice: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        if self.hardware.is_cpu:
            return self._node_ram // self._workers_per_node  # workers of a node share its RAM
        return self.hardware.memory_bytes

    @property
    def _node_ram(self) -> int:
        ram = self.recipe.hardware.host_ram_gb
        return int(ram * GiB) if ram else self.hardware.memory_bytes

    @property
    def _workers_per_node(self) -> int:
        return max(1, self.setup.world // self.setup.nodes)

    @property
    def checks_against(self) -> str:
        """What the capacity is, in words: the GPU profile's name, or a worker's share of the host memory."""
        if not self.hardware.is_cpu:
            return self.hardware.name
        n = self._workers_per_node
        return f"host memory, {self._node_ram / GiB:.1f} GiB per node / {n} worker{'s' if n > 1 else ''}"

    @property
    def usable(self) -> int:
        """What the estimate must stay under: capacity less the CUDA context and allocator slack (GPUs)."""
        if self.hardware.is_cpu:
            return self.capacity
        return usable_gpu_bytes(self.capacity)

    @property
    def host_ok(self) -> bool:
        ram = self.recipe.hardware.host_ram_gb
        return ram is None or self.hardware.is_cpu or self.estimate.host_bytes <= ram * GiB

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.usable and self.host_ok

    @property
    def headroom(self) -> int:
        return self.usable - self.estimate.total

    @property
    def low_headroom(self) -> bool:
        """Fits, with less than MIN_HEADROOM of usable memory left: plan and the pre-flight warn (plan/headroom.py),
        and `--fit` offers no such run (plan/search.py)."""
        return self.fits and self.headroom < MIN_HEADROOM * self.usable

    def to_json(self) -> dict:
        e = self.estimate
        return {
            "model": {"params": self.stats.num_params, "trainable_params": e.trainable_params,
                      "lora_params": e.lora_params, "units": len(e.units)},
            "world_size": self.setup.world,
            "shard_group_size": self.setup.shard_size,
            "per_rank": dict(e.per_rank),
            "peak_phase": e.peak_phase,
            "phases": dict(e.phases),
            "host": {"total_bytes": e.host_bytes, "per_rank_bytes": e.host_per_rank,
                     "ram_bytes": int(self.recipe.hardware.host_ram_gb * GiB) if self.recipe.hardware.host_ram_gb
                     else None},
            "hardware": self.hardware.key,
            "capacity_bytes": self.capacity,
            "capacity_of": self.checks_against,
            "usable_bytes": self.usable,
            "headroom_bytes": self.headroom,
            "fits": self.fits,
            "advice": list(self.advice),
            "quantized_base": quantized_summary(e) if self.setup.nf4 and self.setup.lora else None,
        }


def quantized_summary(e: Estimate) -> dict:
    """What lora.quantize_base=nf4 quantizes (the units' frozen Linear weights) and what stays unquantized."""
    names = sorted({n.rsplit(".", 1)[0].replace(".base_layer", "").rsplit(".", 1)[-1]
                    for u in e.units for n, _ in u.quantized_weights})
    weights = sum(math.prod(shape) for u in e.units for _, shape in u.quantized_weights)
    return {"format": "nf4", "modules": names, "weights": weights,
            "bytes": sum(u.quantized.numel for u in e.units if u.quantized),  # codes + scales, unpadded
            "per_rank_bytes": sum(u.quantized.shard_bytes() for u in e.units if u.quantized),  # with padding
            "unquantized": "embeddings, norms, lm_head (engine.mixed_precision)"}


def variant(plan: Plan, **changes) -> Plan:
    """The same recipe with some Setup fields changed (a --fit candidate or an advice item)."""
    return Plan(plan.recipe, plan.stats, dataclasses.replace(plan.setup, **changes),
                estimate(plan.stats, dataclasses.replace(plan.setup, **changes)), plan.hardware)
