"""A process's start-up: the training stack (torch, transformers) imported with the cyclic garbage collector off.

Those imports make about a million container objects (classes, functions, dicts). CPython's collector runs after
every 700 net allocations, and every few runs it scans all of them; none is garbage. With it off while they are
imported, `python -c "import shardtune.trainer.train"` takes 13 % less CPU (median of 8 runs on a 2-core VM:
7.66 -> 6.64 CPU-s). A worker's setup and `validate` import the stack this way.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """The collector off inside, back on when leaving if it was on (nested uses leave it to the outermost). Only
    around imports: garbage made inside waits for the next collection."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
