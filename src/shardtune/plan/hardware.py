"""Hardware profiles (`configs/hardware/*.yaml`): capacity, throughput and link bandwidths that `plan` checks against."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import yaml

from shardtune.bundled import CONFIGS_DIR
from shardtune.errors import UserError

if TYPE_CHECKING:
    from shardtune.config.schema import Recipe

HARDWARE_DIR = CONFIGS_DIR / "hardware"
GB = 1e9
GiB = 1 << 30
FRAGMENTATION = 0.05  # allocator slack on GPUs (caching allocator blocks, fragmentation)
CUDA_CONTEXT = 1 * GiB  # CUDA context + NCCL buffers + kernels: outside the allocator's counters


def usable_gpu_bytes(capacity: int) -> int:
    """What a GPU plan's peak must stay under: capacity less allocator slack and the CUDA context."""
    return int(capacity * (1 - FRAGMENTATION)) - CUDA_CONTEXT


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    key: str  # file stem, e.g. rtx4090-24gb
    name: str
    memory_bytes: int  # device memory (host RAM for `cpu`)
    bf16_tflops: float  # dense peak; plan assumes a fraction of it (MFU) is reached
    intra_node_gbps: float  # GB/s per GPU between GPUs of one node
    inter_node_gbps: float  # GB/s per GPU between nodes
    pcie_gbps: float  # GB/s host <-> device
    memory_gbps: float = 1000.0  # GB/s device memory bandwidth: NF4 dequantization is bound by it

    @property
    def is_cpu(self) -> bool:
        return self.key == "cpu"


def host_ram_bytes() -> int | None:
    """MemTotal from /proc/meminfo (Linux), else the physical page count (POSIX); no psutil. What a CPU recipe is
    checked against when hardware.host_ram_gb is not set, by `plan` and by train's pre-flight."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def planned_profile(recipe: Recipe) -> HardwareProfile:
    """What `plan` checks a recipe against: its `hardware.gpu` profile; a CPU recipe (launch.device=cpu) runs in host
    memory: the `cpu` profile holding the RAM present, as train's pre-flight reads it (hardware.host_ram_gb, when
    set, is the node's RAM instead: Plan.capacity)."""
    profile = load_profile("cpu" if recipe.launch.device == "cpu" else recipe.hardware.gpu)
    present = host_ram_bytes() if profile.is_cpu else None
    return dataclasses.replace(profile, memory_bytes=present) if present else profile


def list_profiles() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_profile(key: str) -> HardwareProfile:
    path = HARDWARE_DIR / f"{key}.yaml"
    if not path.is_file():
        raise UserError(f"hardware.gpu: unknown profile '{key}': choose one of {', '.join(list_profiles())}")
    data = yaml.safe_load(path.read_text())
    return HardwareProfile(key=key, name=data["name"], memory_bytes=int(data["memory_bytes"]),
                           bf16_tflops=float(data["bf16_tflops"]), intra_node_gbps=float(data["intra_node_gbps"]),
                           inter_node_gbps=float(data["inter_node_gbps"]), pcie_gbps=float(data["pcie_gbps"]),
                           memory_gbps=float(data.get("memory_gbps", 1000.0)))
