"""Hardware profiles (`configs/hardware/*.yaml`): capacity, throughput and link bandwidths that `plan` checks against."""
from __future__ import annotations

from dataclasses import dataclass

import yaml

from shardtune.bundled import CONFIGS_DIR
from shardtune.errors import UserError

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
