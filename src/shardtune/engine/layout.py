"""Which parameter goes into which flat buffer, in what order, padded to what size. Pure: no process group, no
copies, works on a meta-device model. The engine (`shard.py`, `flat_param.py`) and `plan` both read it, so the
memory preview and the real buffers cannot drift apart.

Per unit (forward order; the root unit last = leftover params: embeddings, final norm, head; tied weights once):
    trainable buffer  [decay params ... | no-decay params ... | padding]   dtype: the params' (fp32 master)
    frozen buffer     [frozen params ...                     | padding]   dtype: the params' (e.g. bf16 base)
each padded to a multiple of the shard-group size W, so every rank owns padded_numel / W elements.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from shardtune.engine.api import ShardingPolicy, splits_vocab
from shardtune.engine.nf4_layout import BLOCK_BYTES, Nf4Layout, quantizable
from shardtune.engine.wrap import find_units
from shardtune.errors import UserError

Entry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]  # (canonical name, param, every (module, attr))


def padded(numel: int, shard_size: int) -> int:
    """Smallest multiple of `shard_size` that holds `numel` elements."""
    return -(-numel // shard_size) * shard_size


@dataclass
class UnitParams:
    """The parameters of one unit, grouped and ordered as the flat buffers lay them out."""

    module: nn.Module
    is_root: bool
    decay: list[Entry] = field(default_factory=list)  # trainable, weight decay
    no_decay: list[Entry] = field(default_factory=list)  # trainable, no weight decay (norms, biases)
    frozen: list[Entry] = field(default_factory=list)  # requires_grad=False
    quantized: list[Entry] = field(default_factory=list)  # frozen Linear weights stored as NF4 (quantize_base)
    vocab: list[Entry] = field(default_factory=list)  # vocab_parallel: root tables, one row-sharded buffer each

    def flat_groups(self) -> list[tuple[list[Entry], bool, int]]:
        """(entries in buffer order, requires_grad, num_decay) for each non-empty flat buffer: trainable first."""
        out = []
        if self.decay or self.no_decay:
            out.append((self.decay + self.no_decay, True, len(self.decay)))
        if self.frozen:
            out.append((self.frozen, False, 0))
        return out


def group_unit_params(module: nn.Module, policy: ShardingPolicy) -> list[UnitParams]:
    """Units in forward order, then the root. `policy.vocab_parallel` as applied to the shard group (`splits_vocab`:
    shard.py, `unit_layouts`): the tables go into `vocab`, else into the root's buffers. Raises UserError for tied
    params split over units, mixed dtypes in one buffer, or an empty root."""
    unit_modules = find_units(module, policy.unit_classes, policy.min_unit_params)
    owner: dict[int, int] = {}  # id(submodule) -> unit index; absent -> root
    for i, um in enumerate(unit_modules):
        for sub in um.modules():
            owner[id(sub)] = i
    names = {id(p): n for n, p in module.named_parameters()}  # canonical (first) name of each parameter
    tables = {id(p) for p in vocab_tables(module)} if policy.vocab_parallel else set()
    locations: dict[int, list[tuple[nn.Module, str]]] = {}
    param_unit: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is None or _is_replicated(policy, names[id(p)], p):
                continue
            u = owner.get(id(m), len(unit_modules))
            if param_unit.setdefault(id(p), u) != u:
                raise UserError(f"engine.wrap: parameter {names[id(p)]} is shared by two units; choose wrap classes "
                                "that keep tied parameters in one unit (or leave them in the root)")
            locations.setdefault(id(p), []).append((m, attr))
            params[id(p)] = p

    units: list[UnitParams] = []
    for i, um in enumerate([*unit_modules, module]):
        up = UnitParams(um, is_root=um is module)
        for k in names:  # named_parameters() order
            if param_unit.get(k) != i:
                continue
            p = params[k]
            entry = (names[k], p, locations[k])
            if k in tables and up.is_root:
                up.vocab.append(entry)
            elif not p.requires_grad:
                (up.quantized if _is_quantized(policy, up, entry) else up.frozen).append(entry)
            elif policy.no_weight_decay(names[k], p):
                up.no_decay.append(entry)
            else:
                up.decay.append(entry)
        for group, grad, _ in up.flat_groups():
            if len({p.dtype for _, p, _ in group}) > 1:
                raise UserError(f"model: {'trainable' if grad else 'frozen'} parameters of one unit have mixed "
                                f"dtypes {sorted({str(p.dtype) for _, p, _ in group})}; load the model in one dtype")
        units.append(up)
    if not units[-1].flat_groups() and not units[-1].vocab:
        raise UserError("engine.wrap: the root unit has no parameters; this engine needs the embeddings outside "
                        "the wrapped blocks (wrap the decoder-block class only)")
    return units


# Config attributes that put something between the head and the softmax (final logit soft-capping, logit scales):
# the fused chunked loss does not apply them, so such a model keeps the plain path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def supports_chunked_loss(model: nn.Module) -> bool:
    """A bias-free Linear head and nothing between it and the softmax. Asked of the module structure, not of the
    weight: a sharded model's head has no `weight` attribute until its unit is gathered."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # nn.Linear(bias=False) registers bias as None; a sharded bias has left _parameters: "absent" is not None
    if not isinstance(head, nn.Linear) or head._parameters.get("bias", "absent") is not None:
        return False
    cfg = getattr(model, "config", None)
    return not any(getattr(cfg, a, None) not in (None, 1, 1.0) for a in _LOGIT_TRANSFORMS)


def vocab_tables(module: nn.Module) -> list[nn.Parameter]:
    """The tables vocab parallelism shards by rows (engine/vocab.py): the input embedding when it is a plain
    nn.Embedding, the head when it is a bias-free nn.Linear with nothing between it and the softmax (engine/loss.py's
    condition). A tied table qualifies only when both uses do. Frozen or trainable; never a LoRA target."""
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    plain = isinstance(emb, nn.Embedding) and type(emb).forward is nn.Embedding.forward  # not a scaled subclass
    emb_w = emb.weight if plain and emb.max_norm is None and not emb.sparse else None
    head_w = head.weight if head is not None and supports_chunked_loss(module) else None
    if emb is not None and head is not None and getattr(emb, "weight", None) is getattr(head, "weight", 0):
        return [emb_w] if emb_w is not None and head_w is not None else []  # tied: both uses or neither
    return [w for w in (emb_w, head_w) if w is not None and w.ndim == 2]


def _is_replicated(policy: ShardingPolicy, name: str, p: nn.Parameter) -> bool:
    return policy.replicated is not None and p.requires_grad and policy.replicated(name, p)


def _is_quantized(policy: ShardingPolicy, up: UnitParams, entry: Entry) -> bool:
    """quantize_base: a frozen weight of nn.Linear modules, or a fused 3-D expert weight (model/experts.py), inside a unit
    (the root stays unquantized), whose shape NF4 takes (whole blocks; per expert, for experts). The rest of the
    unit's frozen params (norms, biases, routers) stay in `frozen`."""
    from shardtune.model.experts import expert_weights, is_experts

    _, p, locations = entry
    return (policy.quantize_base and not up.is_root and quantizable(p.shape)
            and all((isinstance(m, nn.Linear) and attr == "weight") or (is_experts(m) and attr in expert_weights(m))
                    for m, attr in locations))


def replicated_params(module: nn.Module, policy: ShardingPolicy) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters that stay out of the flat buffers, whole on every rank (LoRA adapters)."""
    return [(n, p) for n, p in module.named_parameters() if _is_replicated(policy, n, p)]


@dataclass(frozen=True)
class FlatLayout:
    numel: int  # T: sum of the params' numels
    padded_numel: int  # P: T rounded up to a multiple of the shard-group size
    shard_numel: int  # P / W: what each rank stores
    dtype: torch.dtype  # master dtype of the shard (the params' dtype)
    requires_grad: bool
    decay_numel: int  # first decay_numel elements get weight decay (trainable buffers)
    uses: int = 1  # modules that compute with it: 2 for a vocabulary table tied to the head

    def shard_bytes(self) -> int:
        return self.shard_numel * _elem(self.dtype)


@dataclass(frozen=True)
class UnitLayout:
    name: str  # module path ("" for the root)
    is_root: bool
    trainable: FlatLayout | None
    frozen: FlatLayout | None
    quantized: FlatLayout | None = None  # NF4 bytes (uint8) of the frozen Linear weights under quantize_base
    quantized_weights: tuple[tuple[str, torch.Size], ...] = ()  # (name, shape) of each weight in `quantized`
    vocab: tuple[FlatLayout, ...] = ()  # vocab_parallel: the root's row-sharded tables, never gathered

    @property
    def gathered(self) -> list[FlatLayout]:
        """The flats an all-gather materializes (not the row-sharded tables)."""
        return [f for f in (self.trainable, self.frozen, self.quantized) if f is not None]

    @property
    def flats(self) -> list[FlatLayout]:
        return [*self.gathered, *self.vocab]

    def padded_numel(self) -> int:
        return sum(f.padded_numel for f in self.flats)


def flat_layout(entries: list[Entry], *, requires_grad: bool, num_decay: int, shard_size: int) -> FlatLayout:
    numel = sum(p.numel() for _, p, _ in entries)
    pad = padded(numel, shard_size)
    return FlatLayout(numel=numel, padded_numel=pad, shard_numel=pad // shard_size, dtype=entries[0][1].dtype,
                      requires_grad=requires_grad, decay_numel=sum(p.numel() for _, p, _ in entries[:num_decay]))


def unit_layouts(module: nn.Module, policy: ShardingPolicy, shard_size: int) -> list[UnitLayout]:
    """Per unit (forward order, root last): the trainable and frozen flat buffers' sizes and dtypes, over a shard
    group of `shard_size` ranks."""
    assert shard_size >= 1
    policy = replace(policy, vocab_parallel=splits_vocab(policy.vocab_parallel, shard_size=shard_size))
    path = {id(m): n for n, m in module.named_modules()}
    out = []
    for up in group_unit_params(module, policy):
        flats: dict[bool, FlatLayout] = {}
        for entries, grad, num_decay in up.flat_groups():
            flats[grad] = flat_layout(entries, requires_grad=grad, num_decay=num_decay, shard_size=shard_size)
        out.append(UnitLayout(name=path[id(up.module)], is_root=up.is_root, trainable=flats.get(True),
                              frozen=flats.get(False), quantized=quantized_layout(up.quantized, policy, shard_size),
                              quantized_weights=tuple((n, p.shape) for n, p, _ in up.quantized),
                              vocab=tuple(vocab_layout(e, shard_size) for e in up.vocab)))
    return out


def vocab_layout(entry: Entry, shard_size: int) -> FlatLayout:
    """A row-sharded table: padded to whole rows per rank (a multiple of W·H elements)."""
    _, p, locations = entry
    pad = padded(p.numel(), shard_size * p.shape[1])
    return FlatLayout(numel=p.numel(), padded_numel=pad, shard_numel=pad // shard_size, dtype=p.dtype,
                      requires_grad=p.requires_grad, decay_numel=p.numel() if p.requires_grad else 0,
                      uses=max(1, len(locations)))


def quantized_layout(entries: list[Entry], policy: ShardingPolicy, shard_size: int) -> FlatLayout | None:
    """The NF4 byte buffer of a unit (engine/quantized.py): each weight's region, padded to whole 32-byte code
    blocks per rank. Dequantized dtype = the compute dtype (sizes its scale factors)."""
    if not entries:
        return None
    numel = sum(Nf4Layout.of(p.shape, policy.mixed_precision.param_dtype).nbytes for _, p, _ in entries)
    pad = padded(numel, shard_size * BLOCK_BYTES)
    return FlatLayout(numel=numel, padded_numel=pad, shard_numel=pad // shard_size, dtype=torch.uint8,
                      requires_grad=False, decay_numel=0)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
