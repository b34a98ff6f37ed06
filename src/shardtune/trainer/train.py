"""The training worker: one process per rank, started by torchrun (see launcher/launch.py). `train()` reads top to bottom."""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune import accelerator
from shardtune import checkpoint as ckpt
from shardtune.checkpoint.paths import TRAINER_FILE
from shardtune.checkpoint.resume_check import fingerprint, trained_recipe
from shardtune.config import Recipe
from shardtune.config.dtypes import DTYPES
from shardtune.config.schema import TrainConfig
from shardtune.data import GlobalBatches, TokenizedData
from shardtune.data.ranks import prepare_for_ranks
from shardtune.engine.api import ShardedModel
from shardtune.errors import UserError
from shardtune.hub import fetch_for_ranks, is_hub_id
from shardtune.model import context_parallel
from shardtune.model.build import build_model, build_tokenizer, check_vocab, load_config
from shardtune.trainer.data_passes import repeat_notice
from shardtune.trainer.evaluate import accuracy_before, demo_samples, exact_match
from shardtune.trainer.export import param_shapes, save_final, write_export_info
from shardtune.trainer.metrics import MetricsLog
from shardtune.trainer.objective import DpoObjective, SftObjective
from shardtune.trainer.parallelize import parallelize
from shardtune.trainer.runtime import Runtime, host_max, init_runtime
from shardtune.trainer.schedule import build_scheduler, keep_settings, optimizer_settings
from shardtune.trainer.signals import EXIT_DIVERGED, StopRequest, stop_message


class TrainingStopped(Exception):
    """Ends the loop early with an exit code (preempted, diverged); the message is for the user."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Run:
    """Everything one worker trains with, built by `setup`."""

    recipe: Recipe
    rt: Runtime
    run_dir: Path
    tok: PreTrainedTokenizerBase
    data: TokenizedData
    model: PreTrainedModel
    sharded: ShardedModel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: GlobalBatches
    objective: SftObjective  # sft or dpo: the step's loss, batches and eval (trainer/objective.py)
    checkpoints: ckpt.CheckpointManager
    shapes: dict[str, Any]  # trainable parameter names -> shape/dtype, read before sharding (for export)
    max_steps: int  # train.max_steps, or train.epochs over the training rows
    prefetched: tuple[int, list[Any], int] | None = None  # (step, its micro-batches on the device, normaliser)
    demo_before: dict[str, Any] | None = None  # the demo's accuracy at step 0 and its sample count (checkpointed)


def train(recipe: Recipe) -> dict:
    run = setup(recipe)
    cfg, rt = recipe.train, run.rt
    start_step = resume(run)
    max_steps = run.max_steps
    log = MetricsLog(run.run_dir, max_steps=max_steps, enabled=rt.is_main, start_step=start_step,
                     log_every=cfg.log_every, show_epoch=cfg.epochs is not None, report_to=cfg.report_to,
                     config=asdict(recipe))
    tracker = _memory_tracker(cfg.profile_memory, rt.device, recipe.engine.backend, compiled=recipe.engine.compile)
    stop = StopRequest()
    demo = demo_samples(run.data, cfg.demo_eval_samples, announce=rt.is_main) if cfg.demo_eval else []
    acc_before, before_note = accuracy_before(run.model, run.tok, demo, rt, start_step=start_step,
                                              recorded=run.demo_before)
    if demo and start_step == 0:
        run.demo_before = {"accuracy": acc_before, "samples": len(demo)}  # the checkpoints carry it to a resume
    skipped = 0

    run.model.train()
    for step in range(start_step, max_steps):
        record = train_step(run, step, tracker, stop)
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            skipped += 1  # the optimizer did not step; the data moves on
            record["skipped"] = True
            if skipped > cfg.skip_nonfinite:
                log.log(record)
                log.close(run.run_dir)
                raise TrainingStopped(f"train: non-finite loss/grad norm at step {step + 1} "
                                      f"(loss={record['loss']}, grad_norm={record['grad_norm']}); last good "
                                      f"checkpoint: {run.checkpoints.latest_name() or 'none'}: lower train.lr or "
                                      f"set train.skip_nonfinite=N", EXIT_DIVERGED)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 or step + 1 == max_steps:
            record.update(run.objective.evaluate(run.model, rt, global_size=run.batches.global_size))
        log.log(record)
        stopping = stop.stopping  # agreed in train_step; a stop saves at any train.save_every, 0 included
        if stopping or cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == max_steps):
            save_checkpoint(run, step + 1)
        if stopping:
            log.close(run.run_dir)
            latest = run.checkpoints.latest_name()  # an earlier one if this save failed (the manager warned)
            saved = run.checkpoints.root / latest if latest else None
            raise TrainingStopped(*stop_message(stop.signum, step + 1, saved, resume=cfg.resume))

    if tracker is not None:
        tracker.stop()  # the dispatch mode costs Python work per op: not during export and decoding
    acc_after = exact_match(run.model, run.tok, demo, rt) if demo else None
    if cfg.save_final:
        save_final(run.sharded, run.model, run.tok, run.run_dir / "final", is_main=rt.is_main)
    log.close(run.run_dir)
    summary = {"final_loss": log.last_loss(), "accuracy_before": acc_before, "accuracy_after": acc_after,
               **run.objective.summary(log.history)}
    if rt.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.print_summary(acc_before, acc_after, before_note)
        run.objective.print_summary(summary)
    return summary


def setup(recipe: Recipe, *, simulated: bool = False) -> Run:
    """`simulated`: on the simulated GPU (accelerator.py), for tests/simulated and `plan --simulate`."""
    rt = init_runtime(recipe.launch, simulated=simulated, compute_dtype=DTYPES[recipe.engine.mixed_precision])
    cfg = recipe.train
    if is_hub_id(recipe.model.path):
        fetch_for_ranks(recipe.model.path, rank=rt.rank)  # rank 0 downloads, the others wait
    tok = build_tokenizer(recipe.model)
    check_vocab(tok, load_config(recipe.model), recipe.model)  # before the data is tokenized
    data = prepare_for_ranks(recipe.data, tok, seed=cfg.seed, output_dir=cfg.output_dir, rank=rt.rank)
    model = build_model(recipe.model, seed=cfg.seed, device=rt.device, sharded_init=True)  # filled by parallelize
    shapes = param_shapes(model)
    sharded = parallelize(model, recipe, device=rt.device, world_size=rt.world_size)
    optimizer = build_optimizer(sharded, cfg)
    objective = build_objective(recipe, data, rt)
    batches = objective.batches(world_size=context_parallel.data_rank(rt.rank, rt.world_size)[1])
    max_steps = steps_for(cfg, num_rows=len(batches.rows), global_size=batches.global_size, announce=rt.is_main)
    scheduler = build_scheduler(cfg.schedule, optimizer, warmup_steps=cfg.warmup_steps, total_steps=max_steps)
    run_dir = Path(cfg.output_dir)
    checkpoints = ckpt.CheckpointManager(run_dir, keep_last=cfg.keep_last, is_main=rt.is_main, rank=rt.rank,
                                         device=rt.device)
    return Run(recipe, rt, run_dir, tok, data, model, sharded, optimizer, scheduler, batches, objective, checkpoints,
               shapes, max_steps)


def steps_for(cfg: TrainConfig, *, num_rows: int, global_size: int, announce: bool) -> int:
    """train.max_steps, or the steps train.epochs takes over `num_rows` training rows (the last one may be partial:
    it wraps into the next epoch's order). A warmup as long as the run leaves the schedule in warmup: said once;
    so is a run of train.max_steps that goes over the data more than once (trainer/data_passes.py)."""
    steps = cfg.max_steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * num_rows / global_size))
    assert steps is not None
    if announce and cfg.epochs is not None:
        print(f"train.epochs={cfg.epochs:g}: {steps} steps of {global_size} rows over {num_rows:,} training rows",
              flush=True)
    repeats = repeat_notice(num_rows=num_rows, steps=steps, global_size=global_size)
    if announce and cfg.epochs is None and repeats:  # train.epochs said it above
        print(repeats, flush=True)
    if announce and cfg.warmup_steps >= steps:
        warnings.warn(f"train.warmup_steps={cfg.warmup_steps} >= the run's {steps} steps: the learning rate never "
                      "leaves warmup; lower train.warmup_steps", stacklevel=2)
    return steps


def build_optimizer(sharded: ShardedModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over this rank's shards. States on the host (a CPU run, or CPU offload of full fine-tuning) step with
    the fused CPU kernel, one pass per tensor; states on a GPU (LoRA adapters, also under offload) take the
    multi-tensor (foreach) path (accelerator.optimizer_flags). Both the offloaded and the plain CPU run take the
    fused path, so offload changes no number."""
    groups = sharded.optimizer_param_groups(cfg.weight_decay)
    flags = accelerator.optimizer_flags([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **flags)


def train_step(run: Run, step: int, tracker: Any, stop: StopRequest | None = None) -> dict[str, Any]:
    """One optimizer step. `stop`: the ranks agree on it here (its `stopping`), on the step's one host read."""
    rt, cfg = run.rt, run.recipe.train
    t0 = time.perf_counter()
    comm0 = run.sharded.comm_bytes()
    if tracker is not None:
        tracker.reset_peak()
    # DPO: reference log-probs and the held-out "before" eval when DPO starts
    start = run.objective.before_step(run.model, rt, run.run_dir, step, global_size=run.batches.global_size)
    micro_batches, norm = device_batches(run, step)
    # Summed on the device (float64: the same sum a Python float gave), the loss first, then the objective's
    # statistics: a host read per micro-step would stop the CPU from running ahead into the next micro-step's gathers.
    sums: torch.Tensor | None = None
    for i, mb in enumerate(micro_batches):
        # Reduce gradients on every micro-step, or only on the last one (unsharded grads kept meanwhile).
        last = i == len(micro_batches) - 1
        run.sharded.set_requires_gradient_sync(run.recipe.engine.sync_every_microstep or last)
        run.sharded.set_requires_all_reduce(last)  # adapters: summed over ranks once per step
        # Divided by the global batch's target count (DPO: pair count): the sum over ranks and micro-steps is the
        # global mean loss.
        loss, mb_stats = run.objective.micro_loss(run.model, mb, norm)
        loss.backward()
        part = torch.cat([loss.detach().double().view(1), mb_stats.detach().double()])
        sums = part if sums is None else sums + part
    assert sums is not None
    # This rank's stop vote rides on the step's all-reduce (a scalar kernel argument: no copy from the host), so every
    # rank reads the same sum at the same step, with no collective or sync of its own (trainer/signals.py).
    sums = torch.cat([sums, sums.new_full((1,), stop.vote() if stop is not None else 0)])
    grad_norm_t = run.sharded.clip_grad_norm_(cfg.max_grad_norm)  # global: identical on every rank
    dist.all_reduce(sums)
    run.prefetched = (step + 1, *device_batches(run, step + 1))  # copies queued before the CPU blocks below
    # The one host read of the step: the skip decision needs the loss and the norm before the optimizer steps.
    # before_step's device figures (DPO's start-of-training eval) come with it.
    pending = [k for k, v in start.items() if isinstance(v, torch.Tensor)]
    both = torch.cat([sums, grad_norm_t.detach().to(sums.device, torch.float64).view(1),
                      *(start[k].detach().to(sums.device, torch.float64).view(1) for k in pending)])
    values = accelerator.to_host(both).tolist()
    *sums_global, votes, grad_norm = values[:len(sums) + 1]
    start.update(zip(pending, values[len(sums) + 1:]))
    if stop is not None:
        stop.settle(votes)
    loss_global, stats_global = sums_global[0], sums_global[1:]
    lr = run.scheduler.get_last_lr()[0]  # this step's rate: the scheduler moves to the next step's below
    if math.isfinite(loss_global) and math.isfinite(grad_norm):  # every rank takes the same branch
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    # The step's time spans the optimizer: on the host its whole run (a CPU run, cpu_offload's host AdamW); a GPU's
    # optimizer is queued here, and the next step's read waits for it (stream order), so in steady state each step's
    # span holds one step's device time, optimizer included. No device sync to time it.
    step_time = time.perf_counter() - t0
    tokens = run.batches.global_size * run.objective.rows_per_item * run.recipe.data.seq_len
    record = {"step": step + 1, "epoch": round((step + 1) * run.batches.global_size / len(run.batches.rows), 4),
              "loss": loss_global, "lr": lr, "grad_norm": grad_norm,
              "tokens": tokens, run.objective.norm_key: norm, "tokens_per_s": tokens / step_time,
              "step_time_s": step_time, **run.objective.metrics(stats_global, norm), **start}
    comm = run.sharded.comm_bytes()
    record["comm_bytes"] = comm - comm0 if comm0 >= 0 else None
    if tracker is not None:
        record["peak_mem_bytes"] = int(host_max(tracker.peak_bytes()))  # a host number: the tracker reads no device
    return record


def device_batches(run: Run, step: int) -> tuple[list[Any], int]:
    """This rank's micro-batches of `step` on the device (copied without a host sync; the previous step prefetched
    them) and the global batch's normaliser."""
    if run.prefetched is not None and run.prefetched[0] == step:
        _, micro, norm = run.prefetched
        run.prefetched = None
        return micro, norm
    micro, norm = run.batches.step(step, context_parallel.data_rank(run.rt.rank, run.rt.world_size)[0])
    return [mb.to(run.rt.device) for mb in micro], norm


def save_checkpoint(run: Run, step: int) -> None:
    state = run.sharded.checkpoint_state(run.optimizer)
    info = {"world_size": run.rt.world_size, "backend": run.recipe.engine.backend, "lora": run.recipe.lora.enabled,
            "fingerprint": fingerprint(run.recipe, run.rt.world_size),  # what checkpoint/resume_check.py compares
            "recipe": trained_recipe(run.recipe),  # and what it says changed on resume
            "demo_before": run.demo_before}
    run.checkpoints.save(step, state, run.scheduler, info,
                         write_hf=lambda d: write_export_info(run.model, run.tok, run.shapes, d))


def resume(run: Run) -> int:
    """Load the checkpoint `train.resume` names (auto: the newest complete one); returns the step to start at."""
    found = ckpt.find_resume_dir(run.run_dir, run.recipe.train.resume, is_main=run.rt.is_main)
    if found is None:
        return 0
    state = run.sharded.checkpoint_state(run.optimizer, for_load=True)
    settings = optimizer_settings(run.optimizer)  # this recipe's: they apply from the resumed step
    step = ckpt.manager.load(found, state, run.scheduler, rank=run.rt.rank, world_size=run.rt.world_size,
                             device=run.rt.device)
    run.sharded.load_checkpoint_state(state, run.optimizer)
    keep_settings(run.optimizer, settings, run.scheduler)
    run.demo_before = json.loads((found / TRAINER_FILE).read_text()).get("demo_before")
    if run.rt.is_main:
        print(f"resumed from {found} at step {step}", flush=True)
    return step


def build_objective(recipe: Recipe, data: TokenizedData, rt: Runtime) -> SftObjective:
    """The step's loss, batches and eval for train.objective (here, not in objective.py: grpo.py builds on that
    module's SftObjective, so choosing among them from there would make an import circle)."""
    if recipe.train.objective == "grpo":
        from shardtune.trainer.grpo import GrpoObjective  # its sampler and reward loaders only when asked for

        return GrpoObjective(recipe, data, rt)
    return DpoObjective(recipe, data) if recipe.train.objective == "dpo" else SftObjective(recipe, data)


def _memory_tracker(enabled: bool, device: torch.device, backend: str, *, compiled: bool):
    if not enabled:
        return None
    from shardtune.memory import CpuMemoryTracker, memory_tracker

    # CPU: a dispatch mode over live storages (slows steps ~2-5x); our engine reports each storage it resizes
    tracker = memory_tracker(device, resizes_reported=backend == "shardtune")
    if compiled and isinstance(tracker, CpuMemoryTracker):  # dynamo refuses to trace under a dispatch mode
        raise UserError("train.profile_memory: the CPU memory tracker is a dispatch mode that compiled blocks cannot "
                        "run under: set train.profile_memory=false or engine.compile=false")
    return tracker.start()
