"""Start-up check that every rank built the same model: one all-gather of a small vector of checksums.

Each rank cuts its shard from a model it built itself (a seeded init, or pieces read from files), so a rank whose
init differs (a non-deterministic custom init, another checkpoint on another node) would train a model that exists
nowhere, silently. What must be equal is the *full* parameters each rank cut from: every rank hashes each unit's
full parameters before cutting (or, for the sharded init, each module as it is materialised), plus the buffers and
the replicated parameters (LoRA adapters), and the ranks compare the hashes.

The hash is exact on bits, so it is the same on every rank for the same bits and changes with any single element.
A host tensor's bytes go through xxHash's XXH3 (the `xxhash` package: ~20 GB/s on one core here, where the
integer sums below read 0.3 GB/s: 9 s of a 1B model's 2-rank start-up, bench/RESULTS.md stop 54). A device
tensor is reinterpreted as integers and summed with position weights modulo a prime, on the device (no copy to the
host); scratch 2 x 8 x max(16 Ki, numel/64) bytes. Every rank holds the same tensor on the same kind of device, so
all take the same path. One all-gather of 8 bytes per unit. One rank compares with no one: callers skip the
hashing (`comparing`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
import xxhash

from shardtune import accelerator
from shardtune.errors import UserError
from shardtune.memory import free_storage

_P = 2_147_483_647  # 2^31 - 1: residues < 2^31, so residue x weight < 2^62 fits int64; chunk sums stay < 2^63
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MIN_CHUNK = 1 << 14
_XXH3_DEVICES = ("cpu",)  # tensors hashed as bytes on the host; the others by integer sums where they are


class Hasher:
    """Accumulates tensors (in a fixed order) into a 63-bit checksum."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)

    def update(self, t: torch.Tensor) -> None:
        flat = t.detach().reshape(-1)
        n = flat.numel()
        self._h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        if n == 0 or t.is_meta:  # no values (the simulated GPU): shape and dtype only
            return
        if flat.device.type in _XXH3_DEVICES:
            self._h.update(xxhash.xxh3_64_digest(flat.contiguous().view(torch.uint8).numpy()))
            return
        bits = flat.view(_BITS[flat.element_size()])
        chunk = min(n, max(MIN_CHUNK, n // 64))  # few Python iterations for big tensors, small scratch for small
        x = torch.empty(chunk, dtype=torch.int64, device=flat.device)
        w = torch.empty(chunk, dtype=torch.int64, device=flat.device)
        sums = []
        for a in range(0, n, chunk):
            m = min(chunk, n - a)
            xs, ws = x[:m], w[:m]
            xs.copy_(bits[a:a + m]).remainder_(_P)
            torch.arange(a + 1, a + m + 1, out=ws).remainder_(_P)  # position weights: a swap changes the sum
            sums.append(int(xs.mul_(ws).remainder_(_P).sum()))  # < 2^31 * chunk: no overflow below 2^32 elements
        self._h.update(",".join(map(str, sums)).encode())

    def note(self, text: str) -> None:
        """Mix in a description (a key, a shape, a dtype name)."""
        self._h.update(text.encode() + b";")

    def value(self) -> int:
        return int.from_bytes(self._h.digest(), "little") >> 1  # 63 bits: fits a signed int64 tensor


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    h = Hasher()
    for t in tensors:
        h.update(t)
    return h.value()


def comparing() -> bool:
    """Whether there are ranks to compare with (a world of 2 or more): else hashing is a read of every weight for
    nothing."""
    return dist.is_initialized() and dist.get_world_size() > 1


def check_same_on_all_ranks(named: list[tuple[str, int]], device: torch.device) -> None:
    """Collective over the world: raise a UserError on every rank naming the first entry whose checksum differs.
    Every rank must pass the same names in the same order (they come from the same model structure)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or not named:
        return
    local = torch.tensor([h for _, h in named], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)  # not counted in the engine's comm bytes: start-up only
    table = accelerator.to_host(torch.stack(gathered))  # world x entries (simulated GPU: zeros, all agree)
    for t in (local, *gathered):  # freed now, not when gloo drops the finished work: exact counts after start-up
        free_storage(t)
    differs = (table != table[0]).any(dim=0)
    if not bool(differs.any()):
        return
    bad = [name for (name, _), d in zip(named, differs.tolist(), strict=True) if d]
    first = int(differs.nonzero()[0])
    ranks = [r for r in range(world) if table[r, first] != table[0, first]]
    raise UserError(f"model: ranks built different initial weights: {bad[0]} (and {len(bad) - 1} more) differ "
                    f"between rank 0 and rank(s) {ranks}. Every rank must build the same model: a seeded, "
                    f"deterministic init and the same model.path files on every node")
