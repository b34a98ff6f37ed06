"""Local ranks for tests and benchmarks: forked from a server that imported torch and transformers once."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.multiprocessing as mp

PRELOAD = ("shardtune", "torch", "torch.distributed", "transformers",  # shardtune first: its log filter (quiet_imports)
           "transformers.models.llama.modeling_llama", "shardtune.trainer.train",
           "matplotlib.figure", "tests.bf16_gemm")  # every run's loss.png (trainer/metrics.py): ~0.7 s of imports per forked run


def start_local_ranks(entry: Callable[..., None], args: tuple, nprocs: int, *, preload: Sequence[str] = PRELOAD,
                      cuda: bool = False) -> None:
    """`entry(rank, *args)` in `nprocs` local processes; raises if any rank fails (the others are terminated).

    Ranks fork from a forkserver that imported `preload` once (per calling process: the first call starts it, and
    its preload list wins). A spawned rank re-imports torch and transformers, ~5 s, which 4 ranks on 2 cores pay
    at once. The server only imports, no torch op runs there, so no OpenMP pool is forked. `cuda`: the ranks use
    the GPU, so they spawn: on a GPU machine the server's imports ask CUDA for its devices, and a child forked after
    that cannot initialise CUDA ("Cannot re-initialize CUDA in forked subprocess", seen on an H200, RESULTS stop 54).
    """
    if cuda:
        mp.start_processes(entry, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    mp.set_forkserver_preload([*preload, "tests.freeze_heap"])
    mp.start_processes(entry, args=args, nprocs=nprocs, join=True, start_method="forkserver")
