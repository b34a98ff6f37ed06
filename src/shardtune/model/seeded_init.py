"""Random init (`model.init=random`), one module at a time, seeded per module: the same weights at every world size.

The model is built on the meta device (`loading.build_empty`: parameters without bytes, buffers real). Each module
that owns parameters is then materialised alone on the host, initialised by the model's own HF `_init_weights`
under a seed derived from (train.seed, module path), and either
- `init_into_shards`: cut into this rank's flat shards (the engine's `pieces`, as the loader does) and freed, so a
  rank holds at most its shards + one module, never the model; or
- `init_full`: kept whole (a model for one process, the torch backend, tests and export references).
Both give bit-identical values: each module's draw depends only on its seed, never on what was drawn before, so
neither the world size nor the order of units changes a weight.

The seed key is the module path as the checkpoint names it (peft's `.base_layer` removed), so a LoRA base gets the
same weights as the plain model. Init runs on the CPU generator (deterministic across machines; the CUDA one is
not the same stream) inside `fork_rng`: the global RNG is left as it was.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn
from transformers import PreTrainedModel

from shardtune.model.fingerprint import Hasher, check_same_on_all_ranks, comparing
from shardtune.model.loading import checkpoint_key


def module_seed(seed: int, path: str) -> int:
    key = checkpoint_key(path + ".")[:-1]
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") >> 1


def _init_fn(model: nn.Module, path: str):
    """The `_init_weights` of the innermost PreTrainedModel holding `path` (composite models dispatch per sub-model,
    as HF's own `initialize_weights` does)."""
    owner, cur = model, model
    for part in path.split(".") if path else []:
        cur = getattr(cur, part)
        if isinstance(cur, PreTrainedModel):
            owner = cur
    assert isinstance(owner, PreTrainedModel), "random init needs a Hugging Face model"
    return owner._init_weights


@torch.no_grad()
def init_module(model: nn.Module, path: str, module: nn.Module, *, seed: int) -> None:
    """Initialise `module`'s own parameters (already materialised) with its derived seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, path))
        _init_fn(model, path)(module)


def by_module(names: list[str]) -> dict[str, list[str]]:
    """Canonical parameter names -> {module path: [attribute, ...]}, in first-seen order."""
    out: dict[str, list[str]] = {}
    for name in names:
        path, _, attr = name.rpartition(".")
        out.setdefault(path, []).append(attr)
    return out


def init_full(model: nn.Module, *, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Materialise every meta parameter of `model` on `device` with the per-module seeded init. A meta tensor
    cannot take real data in place: each is replaced by a new Parameter at every (module, attr) holding it, so
    tied parameters stay one object, drawn once through the module that owns the canonical name."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None and p.is_meta:
                holders.setdefault(id(p), []).append((m, attr))
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    for path, attrs in by_module(meta).items():
        module = model.get_submodule(path)
        old = [module._parameters[a] for a in attrs]
        new = [nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad) for p in old]
        for a, p in zip(attrs, new, strict=True):
            module._parameters[a] = p  # host first: the CPU generator draws the values
        init_module(model, path, module, seed=seed)
        for p_old, p in zip(old, new, strict=True):
            p = nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)  # noqa: PLW2901 (any device type)
            for m, attr in holders[id(p_old)]:
                m._parameters[attr] = p


def _fill_unit(model: nn.Module, unit, *, seed: int, dtype: torch.dtype, hasher: Hasher | None) -> None:
    """One module at a time, over all of the unit's flat buffers (a module's parameters may sit in two: trainable
    and frozen), so each module is drawn once, whole, exactly as `init_full` draws it."""
    where: dict[str, tuple] = {}  # canonical name -> (flat, slot, [(start in param, start in shard, length)])
    for flat in unit.flats:
        for slot in flat.slots:
            where[slot.name] = (flat, slot, [])
        if hasattr(flat, "fill"):  # NF4 base (engine/quantized.py): its pieces are bytes, it quantizes itself
            continue
        for i, p_start, s_start, n in flat.pieces():
            where[flat.slots[i].name][2].append((p_start, s_start, n))
    for path, attrs in by_module(list(where)).items():
        module = model.get_submodule(path)
        assert not any(a in module._parameters for a in attrs), "the engine removed the sharded parameters"
        fresh = {a: nn.Parameter(torch.empty(where[_join(path, a)][1].shape, dtype=dtype), requires_grad=False)
                 for a in attrs}
        module._parameters.update(fresh)  # what _init_weights reads and writes, for this module only
        try:
            init_module(model, path, module, seed=seed)
        finally:
            for a in attrs:
                del module._parameters[a]
        for a, t in fresh.items():
            flat, _, pieces = where[_join(path, a)]
            if hasattr(flat, "fill"):  # quantize the drawn weight in chunks, keep this rank's bytes
                values = t.reshape(-1)
                flat.fill(lambda _name, v=values: (lambda start, length: v[start:start + length]),
                          only={_join(path, a)})
            for p_start, s_start, n in pieces:
                flat.shard[s_start:s_start + n].copy_(t.reshape(-1)[p_start:p_start + n])  # casts (bf16 base)
            if hasher is not None:
                hasher.update(t)  # the full module, before it is freed: what every rank must agree on
        del fresh


def _join(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def init_into_shards(units: list, model: nn.Module, *, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """Fill each unit's flat shards (`engine.flat_param.FlatParam`, zero-filled, built from a meta model) with this
    rank's pieces of the seeded init; then check (one all-gather) that every rank drew the same full modules."""
    paths = {id(m): n for n, m in model.named_modules()}
    named: list[tuple[str, int]] = []
    compare = comparing()  # one rank: no hashing (at 1B on an H200's host, 9 s of the start-up before xxHash)
    for unit in units:
        hasher = Hasher() if compare else None
        _fill_unit(model, unit, seed=seed, dtype=dtype, hasher=hasher)
        if hasher is not None:
            path = paths[id(unit.module)]
            named.append((f"unit '{path}'" if path else "the root unit (embeddings, final norm, head)",
                          hasher.value()))
    check_same_on_all_ranks(named, device)
