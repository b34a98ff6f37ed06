"""`shardtune --version`: what a bug report needs to reproduce a run (package, Python, torch, CUDA/NCCL, HF stack).

Imports torch (about 1-2 s) because CUDA and NCCL availability can only be asked of it; the other libraries are
read from their installed metadata so that transformers' own import (several seconds) is not paid here.
"""
from __future__ import annotations

import platform
from importlib import metadata

import shardtune

# Libraries whose version changes behaviour a user can report (loading, tokenization, LoRA, the CLI itself).
LIBRARIES = ("transformers", "tokenizers", "peft", "datasets", "accelerate", "safetensors", "typer")


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_lines() -> list[str]:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), {torch.cuda.get_device_name(0)}"
    elif torch.version.cuda:
        cuda = f"CUDA {torch.version.cuda} build, no GPU visible"
    else:
        cuda = "CPU-only build, no CUDA"
    nccl = "not available"
    if dist.is_available() and dist.is_nccl_available():
        nccl = "available, version " + ".".join(map(str, torch.cuda.nccl.version()))
    gloo = "available" if dist.is_available() and dist.is_gloo_available() else "not available"
    return [f"torch {torch.__version__}: {cuda}", f"NCCL {nccl}; gloo {gloo}"]


def version_report() -> str:
    lines = [f"shardtune {shardtune.__version__}",
             f"python {platform.python_version()} ({platform.system()} {platform.machine()})",
             *_torch_lines(),
             ", ".join(f"{name} {_installed(name)}" for name in LIBRARIES)]
    return "\n".join(lines)
