"""engine.backend=shardtune: `shard_model`, the one public entry point of our FSDP engine (contract in api.py).

Process groups per strategy (W ranks):
  full_shard, shard_grad_op: shard group = all W ranks, no replicate group.
  hybrid_shard (size S):     shard groups of S consecutive ranks; replicate groups {r, r+S, r+2S, ...}.
  no_shard:                  no shard group (each rank holds everything); replicate group = all W ranks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from shardtune import accelerator
from shardtune.engine.api import ShardingPolicy, ShardingStrategy, splits_vocab
from shardtune.engine.clip import scale_grads_, sq_norm
from shardtune.engine.collectives import all_gather_into, all_reduce_
from shardtune.engine.flat_param import FlatParam
from shardtune.engine.layout import group_unit_params, replicated_params
from shardtune.engine.quantized import QuantizedFlat
from shardtune.engine.reduce import GradReducer
from shardtune.engine.replicated import ReplicatedParams
from shardtune.engine.unit import EngineContext, Unit, group_size
from shardtune.errors import UserError
from shardtune.memory import free_storage
from shardtune.model.fingerprint import check_same_on_all_ranks, checksum
from shardtune.model.lora_grads import take_adapter_gradients


def build_groups(strategy: ShardingStrategy, hybrid_shard_size: int | None
                 ) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """(shard_group, replicate_group); None stands for a group of one rank. Collective over the world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if strategy is ShardingStrategy.NO_SHARD:
        return None, (dist.group.WORLD if world > 1 else None)
    if strategy is not ShardingStrategy.HYBRID_SHARD or world == 1:
        return (dist.group.WORLD if world > 1 else None), None
    size = hybrid_shard_size or world
    if size < 1 or world % size:
        raise UserError(f"engine.hybrid_shard_size={hybrid_shard_size} must divide the world size {world}")
    shard_group = replicate_group = None
    for start in range(0, world, size):  # every rank must create every group, in the same order
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            shard_group = g
    for offset in range(size):
        g = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            replicate_group = g
    return (shard_group if size > 1 else None), (replicate_group if world > size else None)


class ShardtuneModel:
    """Handle returned by `shard_model`: the module (call it as usual) plus the sharded-optimizer helpers."""

    def __init__(self, module: nn.Module, units: list[Unit], ctx: EngineContext, policy: ShardingPolicy) -> None:
        self.module = module
        self.units = units  # non-root units in forward order, then the root unit
        self.ctx = ctx
        self.policy = policy

    def _segments(self) -> Iterator[tuple[bool, nn.Parameter]]:
        for u in self.units:
            for flat in u.flats:
                for decay, _, _, seg in flat.segments:
                    yield decay, seg

    def _replicated(self) -> Iterator[tuple[bool, nn.Parameter]]:
        # shard_replicated_states: this rank steps its own run of the adapters only
        for name, p in self.ctx.replicated.owned_named_params():
            yield not self.policy.no_weight_decay(name, p), p

    def optimizer_param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        params = [*self._segments(), *self._replicated()]
        return [{"params": [p for d, p in params if d], "weight_decay": weight_decay},
                {"params": [p for d, p in params if not d], "weight_decay": 0.0}]

    def wait_reductions(self) -> None:
        """Every gradient reduced into its shard and every offload copy done (CPU: blocks on their events). Clipping
        calls it; call it before reading shard gradients or stepping without clipping."""
        self.ctx.reducer.wait()
        for u in self.units:
            for flat in u.flats:
                flat.wait_host_reads()  # the host optimizer may now write shards the device was copying

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.wait_reductions()
        grads = [p.grad for _, p in self._segments() if p.grad is not None]
        sq = sq_norm(grads, self.ctx.device)
        # Sum over the shard group only: replicas (hybrid/no_shard) hold identical shards. Padding is not in any
        # segment, so it never counts. One all-reduce of one scalar.
        all_reduce_(sq, self.ctx.shard_group, self.ctx.counter)
        # Replicated params (LoRA adapters) hold the same reduced gradient on every rank: added once, after; with
        # sharded states each rank holds its own run's: summed over the ranks (one more scalar all-reduce).
        replicated = self.ctx.replicated.grads()
        sq_rep = sq_norm(replicated, self.ctx.device)
        all_reduce_(sq_rep, self.ctx.replicated.sq_norm_group(), self.ctx.counter)
        total = (sq + sq_rep).sqrt()
        scale_grads_(grads + replicated, total, max_norm)  # offload: shard grads on the host, adapters on the device
        return total

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.ctx.step.requires_grad_sync = sync

    def set_requires_all_reduce(self, requires: bool) -> None:
        self.ctx.step.requires_all_reduce = requires

    def comm_bytes(self) -> int:
        return self.ctx.counter.bytes

    def model_state_bytes(self) -> int:
        """This rank's sharded params (+ their grads when live) and unsharded grads kept while sync is off;
        excludes optimizer state and gathered parameter buffers."""
        self.wait_reductions()
        kept = sum(g.nbytes for g in self.ctx.reducer.unsharded.values())
        return sum(f.state_bytes() for u in self.units for f in u.flats) + kept + self.ctx.replicated.state_bytes()

    def padded_numels(self) -> list[list[int]]:
        """Per unit (forward order, root last): padded numel P of each gathered flat buffer (row-sharded vocabulary
        tables are never gathered: not listed). For accounting tests/bench."""
        return [[f.padded_numel for f in u.flats if not f.local] for u in self.units]

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Gathers one flat buffer at a time (master dtype): rank 0 holds what it yielded plus one unit."""
        rank0 = dist.get_rank() == 0
        for u in self.units:
            for flat in u.flats:
                full = torch.empty(flat.padded_numel, dtype=flat.dtype, device=self.ctx.device)
                if self.ctx.shard_group is None:
                    full.copy_(flat.shard)
                else:
                    all_gather_into(full, flat.shard.to(self.ctx.device), self.ctx.shard_group, self.ctx.counter,
                                    label=flat.label)
                if rank0 and isinstance(flat, QuantizedFlat):
                    yield from ((n, accelerator.to_host(t, copy=True)) for n, t in flat.dequantized(full))  # what compute sees
                elif rank0:
                    for s in flat.slots:
                        yield s.name, accelerator.to_host(full[s.offset:s.offset + s.numel].view(s.shape), copy=True)
                free_storage(full)  # not `del`: a finished gloo work may still reference it (rank 0: yielded + 1 unit)

    # -- checkpoints (see state_dict.py): per-original-parameter keys, loadable at another world size ---------------
    def checkpoint_state(self, optimizer: torch.optim.Optimizer, *, for_load: bool = False) -> dict[str, Any]:
        from shardtune.engine import state_dict

        self.wait_reductions()
        shard_rank = 0 if self.ctx.shard_group is None else dist.get_rank(self.ctx.shard_group)
        return state_dict.checkpoint_state(self.units, shard_rank, group_size(self.ctx.shard_group), optimizer,
                                           self.module, for_load=for_load)

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """After `dcp.load(state)` filled the chunks in place (state from `checkpoint_state(for_load=True)`)."""
        from shardtune.engine import state_dict

        state_dict.after_load(state, optimizer)


def _unit_name(path: str) -> str:
    return f"unit '{path}'" if path else "the root unit (embeddings, final norm, head)"


def _check_master_dtype(unit_params: list) -> None:
    """The shard of a trainable buffer is the master copy (AdamW steps it, its gradient accumulates in its dtype):
    a 16-bit one would silently train in bf16. Mixed precision gives bf16 compute with fp32 masters."""
    for up in unit_params:
        for entries, grad, _ in up.flat_groups():
            dtype = entries[0][1].dtype
            if grad and dtype.is_floating_point and dtype.itemsize < 4:
                raise UserError(f"model: trainable parameters in {dtype} would make master weights, gradients and "
                                "AdamW state that dtype: build the model in fp32 (model.dtype=fp32) and compute in "
                                "bf16 with engine.mixed_precision=bf16")


def shard_model(module: nn.Module, policy: ShardingPolicy, *, device: torch.device) -> ShardtuneModel:
    shard_group, replicate_group = build_groups(policy.strategy, policy.hybrid_shard_size)
    shard_size = group_size(shard_group)
    shard_rank = 0 if shard_group is None else dist.get_rank(shard_group)
    # What depends on where it runs: vocabulary rows split only over 2+ ranks, AUTO's backward schedule
    policy = dataclasses.replace(policy, vocab_parallel=splits_vocab(policy.vocab_parallel, shard_size=shard_size),
                                 backward_schedule=policy.backward_schedule.on(
                                     accelerator=accelerator.is_accelerator(device)))
    ctx = EngineContext(strategy=policy.strategy, shard_group=shard_group, replicate_group=replicate_group,
                        reduce_dtype=policy.mixed_precision.reduce_dtype, prefetch=policy.prefetch, device=device,
                        backward_schedule=policy.backward_schedule)
    for m in module.modules():  # buffers (e.g. rotary inv_freq) are not sharded: move them as they are
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)
    # Replicated params (LoRA adapters) stay nn.Parameters on their modules, fp32, on the compute device.
    replicated = replicated_params(module, policy)
    for _, p in replicated:
        moved = p.data.to(device=device, dtype=torch.float32)
        if moved.device.type == p.device.type:
            p.data = moved
        else:  # `.data =` cannot change the tensor type (host -> meta, the simulated GPU): swap the contents
            torch.utils.swap_tensors(p, nn.Parameter(moved, requires_grad=p.requires_grad))
    if policy.cpu_offload:
        ctx.copy_stream = accelerator.new_stream(device, "h2d")  # None on the host: copies run inline
    ctx.reducer = GradReducer(shard_group=shard_group, replicate_group=replicate_group,
                              reduce_dtype=ctx.reduce_dtype, device=device, counter=ctx.counter,
                              offload=policy.cpu_offload)
    world = dist.get_world_size()
    ctx.replicated = ReplicatedParams(replicated, dist.group.WORLD if world > 1 else None, ctx.counter,
                                      device=device, shard_states=policy.shard_replicated_states)
    if world == 1:  # nothing reduces the adapters' gradients: their blocks sum them, outside autograd
        take_adapter_gradients(module)  # (model/lora_grads.py: 4 kernels fewer per adapted Linear per micro-batch)

    compute = policy.mixed_precision.param_dtype
    units: list[Unit] = []
    unit_params = group_unit_params(module, policy)  # layout.py: shared with `plan`; raises the UserErrors
    _check_master_dtype(unit_params)
    # Each rank cuts its shard from the full model it built: check that all ranks built the same (fingerprint.py).
    # Meta parameters are filled later (model/loading.py, model/seeded_init.py), which check what they fill.
    # One rank has no one to disagree with: no hashing (a read of every parameter).
    paths = {id(m): n for n, m in module.named_modules()}
    if world > 1:
        check_same_on_all_ranks(
            [(_unit_name(paths[id(up.module)]), checksum(p for g in [*(g for g, _, _ in up.flat_groups()), up.vocab]
                                                          for _, p, _ in g if not p.is_meta)) for up in unit_params]
            + [("buffers", checksum(module.buffers())), ("replicated parameters (LoRA adapters)",
                                                        checksum(p for _, p in replicated))], device)
    for i, up in enumerate(unit_params):
        um = up.module
        flats = [FlatParam(entries, requires_grad=grad, num_decay=nd, shard_rank=shard_rank, shard_size=shard_size,
                           compute_dtype=compute, device=device, offload=policy.cpu_offload) for entries, grad, nd in up.flat_groups()]
        if up.quantized:  # QLoRA base: NF4 bytes, one more frozen flat of the unit (engine/quantized.py)
            flats.append(QuantizedFlat(up.quantized, nf4_dtype=compute, shard_rank=shard_rank, shard_size=shard_size,
                                       device=device, offload=policy.cpu_offload, tile_bytes=policy.nf4_tile_bytes))
        for k, entry in enumerate(up.vocab):  # vocab_parallel: each table row-sharded, never gathered (vocab.py)
            name, p, _ = entry
            vflat = FlatParam([entry], requires_grad=p.requires_grad,
                              num_decay=0 if policy.no_weight_decay(name, p) else 1, shard_rank=shard_rank,
                              shard_size=shard_size, compute_dtype=compute, device=device,
                              offload=policy.cpu_offload, pad_multiple=shard_size * p.shape[1])
            vflat.local = True
            vflat.segment_prefix = f"_shardtune_flat_vocab{k}_"
            vflat.register_name = f"_shardtune_flat_vocab{k}_frozen"
            flats.append(vflat)
        # The original parameters leave the module; `model.parameters()` now yields this rank's shard segments.
        for flat in flats:
            flat.label = "root" if up.is_root else f"unit{i}"
            for slot in flat.slots:
                for m, attr in slot.locations:
                    del m._parameters[attr]
            for j, (decay_seg, _, _, seg) in enumerate(flat.segments):
                prefix = getattr(flat, "segment_prefix", "_shardtune_flat_")
                um.register_parameter(f"{prefix}{'decay' if decay_seg else 'no_decay'}_{j}", seg)
            if not flat.requires_grad:
                um.register_parameter(getattr(flat, "register_name", "_shardtune_flat_frozen"),
                                      nn.Parameter(flat.shard, requires_grad=False))
        units.append(Unit(um, flats, ctx, index=-1 if up.is_root else i, is_root=up.is_root))
    ctx.units, ctx.root = units[:-1], units[-1]
    _install_vocab_tables(ctx, units[-1], replicate_group)
    return ShardtuneModel(module, units, ctx, policy)


def _install_vocab_tables(ctx: EngineContext, root: Unit, replicate_group: ProcessGroup | None) -> None:
    """Route the embedding and head through their row-sharded tables (vocab.py). Hybrid: a trainable table's
    local gradient is summed over the replicas at the end of a synced backward, like the adapters."""
    from shardtune.engine.vocab import VocabTable, install

    segments, tables = [], []
    for flat in (f for f in root.flats if f.local):
        assert ctx.shard_group is not None, "vocab_parallel needs a shard group of more than one rank"
        slot = flat.slots[0]
        mods = [m for m, _ in slot.locations]
        emb = next((m for m in mods if isinstance(m, nn.Embedding)), None)
        head = next((m for m in mods if isinstance(m, nn.Linear)), None)
        table = VocabTable(flat, num_rows=slot.shape[0], hidden=slot.shape[1], group=ctx.shard_group,
                           counter=ctx.counter, device=ctx.device,
                           padding_idx=emb.padding_idx if emb is not None else None,
                           reduce_dtype=ctx.reduce_dtype, reducer=ctx.reducer,
                           copy_stream=ctx.copy_stream)
        install(table, emb, head)
        tables.append(table)
        segments += [(slot.name, seg) for _, _, _, seg in flat.segments]
    if segments and replicate_group is not None:
        # Offloaded tables: the replicas' sum goes back to the host through the table (a D2H on the copy stream)
        by_segment = {id(seg): t for t in tables for _, _, _, seg in t.flat.segments}
        land = ((lambda seg, grad: by_segment[id(seg)].grad_to_host(grad, reduced=True))
                if any(t.flat.on_host for t in tables) else None)
        ctx.vocab_replicas = ReplicatedParams(segments, replicate_group, ctx.counter, device=ctx.device,
                                              label="vocab", land=land)
        for table in tables:
            table.replicas = ctx.vocab_replicas
