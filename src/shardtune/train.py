"""The training worker: one process per rank, started by torchrun (see launch.py). `train()` reads top to bottom."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shardtune import accelerator
from shardtune import checkpoint as ckpt
from shardtune.config import Recipe
from shardtune.config.schema import TrainConfig
from shardtune.data import GlobalBatches, TokenizedData
from shardtune.data.ranks import prepare_for_ranks
from shardtune.engine.api import ShardedModel
from shardtune.evaluate import eval_loss, exact_match, token_loss_sum
from shardtune.export import param_shapes, save_final, write_export_info
from shardtune.metrics import MetricsLog
from shardtune.model import build_model, build_tokenizer
from shardtune.parallelize import parallelize
from shardtune.runtime import Runtime, all_reduce_max, init_runtime
from shardtune.schedule import build_scheduler
from shardtune.signals import EXIT_DIVERGED, EXIT_PREEMPTED, StopRequest


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
    checkpoints: ckpt.CheckpointManager
    shapes: dict[str, Any]  # trainable parameter names -> shape/dtype, read before sharding (for export)


def train(recipe: Recipe) -> dict:
    run = setup(recipe)
    cfg, rt = recipe.train, run.rt
    start_step = resume(run)
    log = MetricsLog(run.run_dir, max_steps=cfg.max_steps, enabled=rt.is_main, start_step=start_step,
                     log_every=cfg.log_every)
    tracker = _memory_tracker(cfg.profile_memory, rt.device)
    stop = StopRequest()
    demo = run.data.eval_raw[: cfg.demo_eval_samples] if cfg.demo_eval else []
    acc_before = exact_match(run.model, run.tok, demo, rt) if demo and start_step == 0 else None
    skipped = 0

    run.model.train()
    for step in range(start_step, cfg.max_steps):
        record = train_step(run, step, tracker)
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
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
            ev = eval_loss(run.model, run.data.eval, rt, micro_batch_size=cfg.micro_batch_size,
                           max_rows=cfg.eval_batches * run.batches.global_size)
            if ev is not None:
                record["eval_loss"] = ev
        log.log(record)
        stopping = stop.agreed(rt.device)
        if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.max_steps or stopping):
            save_checkpoint(run, step + 1)
        if stopping:
            log.close(run.run_dir)
            raise TrainingStopped(f"stopped by signal {stop.signum} after step {step + 1}; checkpoint: "
                                  f"{run.checkpoints.latest_name() or 'none (train.save_every=0)'}", EXIT_PREEMPTED)

    if tracker is not None:
        tracker.stop()  # the dispatch mode costs Python work per op: not during export and decoding
    acc_after = exact_match(run.model, run.tok, demo, rt) if demo else None
    if cfg.save_final:
        save_final(run.sharded, run.model, run.tok, run.run_dir / "final", is_main=rt.is_main)
    log.close(run.run_dir)
    summary = {"final_loss": log.last_loss(), "accuracy_before": acc_before, "accuracy_after": acc_after}
    if rt.is_main:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.print_summary(acc_before, acc_after)
    return summary


def setup(recipe: Recipe, *, simulated: bool = False) -> Run:
    """`simulated`: on the simulated GPU (accelerator.py), for tests/simulated and `plan --simulate`."""
    rt = init_runtime(recipe.launch, simulated=simulated)
    cfg = recipe.train
    tok = build_tokenizer(recipe.model)
    data = prepare_for_ranks(recipe.data, tok, seed=cfg.seed, output_dir=cfg.output_dir, rank=rt.rank)
    model = build_model(recipe.model, seed=cfg.seed, device=rt.device, sharded_init=True)  # filled by parallelize
    shapes = param_shapes(model)
    sharded = parallelize(model, recipe, device=rt.device, world_size=rt.world_size)
    optimizer = build_optimizer(sharded, cfg)
    scheduler = build_scheduler(cfg.schedule, optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.max_steps)
    batches = GlobalBatches(data.train, micro_batch_size=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                            world_size=rt.world_size, seed=cfg.seed)
    run_dir = Path(cfg.output_dir)
    checkpoints = ckpt.CheckpointManager(run_dir, keep_last=cfg.keep_last, is_main=rt.is_main, rank=rt.rank,
                                         device=rt.device)
    return Run(recipe, rt, run_dir, tok, data, model, sharded, optimizer, scheduler, batches, checkpoints, shapes)


def build_optimizer(sharded: ShardedModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over this rank's shards. States on the host (a CPU run, or CPU offload of full fine-tuning) step with
    the fused CPU kernel, one pass per tensor; states on a GPU (LoRA adapters, also under offload) take the
    multi-tensor (foreach) path (accelerator.optimizer_flags). Both the offloaded and the plain CPU run take the
    fused path, so offload changes no number."""
    groups = sharded.optimizer_param_groups(cfg.weight_decay)
    flags = accelerator.optimizer_flags([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **flags)


def train_step(run: Run, step: int, tracker: Any) -> dict[str, Any]:
    rt, cfg = run.rt, run.recipe.train
    t0 = time.perf_counter()
    comm0 = run.sharded.comm_bytes()
    if tracker is not None:
        tracker.reset_peak()
    micro_batches, num_targets = run.batches.step(step, rt.rank)
    # Summed on the device (float64: the same sum a Python float gave): a host read per micro-step would stop the
    # CPU from running ahead into the next micro-step's gathers.
    loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
    for i, mb in enumerate(micro_batches):
        mb = mb.to(rt.device)
        # Reduce gradients on every micro-step, or only on the last one (unsharded grads kept meanwhile).
        run.sharded.set_requires_gradient_sync(run.recipe.engine.sync_every_microstep or i == len(micro_batches) - 1)
        # Divide by the global target count: the sum over ranks and micro-steps is the global mean loss.
        loss = token_loss_sum(run.model, mb.input_ids, mb.labels, mb.position_ids) / num_targets
        loss.backward()
        loss_sum += loss.detach().double()
    norm = run.sharded.clip_grad_norm_(cfg.max_grad_norm)  # global: identical on every rank
    dist.all_reduce(loss_sum)
    # The one host read of the step: the skip decision needs both values before the optimizer steps.
    both = torch.stack([loss_sum, norm.detach().to(loss_sum.device, torch.float64)])
    loss_global, grad_norm = accelerator.to_host(both).tolist()
    if math.isfinite(loss_global) and math.isfinite(grad_norm):  # every rank takes the same branch
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    accelerator.synchronize(rt.device)  # the step's device work is done: step_time (and tokens/s) measure it
    step_time = time.perf_counter() - t0
    tokens = run.batches.global_size * run.recipe.data.seq_len
    record = {"step": step + 1, "loss": loss_global, "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
              "tokens": tokens, "target_tokens": num_targets, "tokens_per_s": tokens / step_time,
              "step_time_s": step_time}
    comm = run.sharded.comm_bytes()
    record["comm_bytes"] = comm - comm0 if comm0 >= 0 else None
    if tracker is not None:
        record["peak_mem_bytes"] = int(all_reduce_max(tracker.peak_bytes(), rt.device))
    return record


def save_checkpoint(run: Run, step: int) -> None:
    state = run.sharded.checkpoint_state(run.optimizer)
    info = {"world_size": run.rt.world_size, "backend": run.recipe.engine.backend, "lora": run.recipe.lora.enabled}
    run.checkpoints.save(step, state, run.scheduler, info,
                         write_hf=lambda d: write_export_info(run.model, run.tok, run.shapes, d))


def resume(run: Run) -> int:
    """Load the checkpoint `train.resume` names (auto: the newest complete one); returns the step to start at."""
    found = ckpt.find_resume_dir(run.run_dir, run.recipe.train.resume, is_main=run.rt.is_main)
    if found is None:
        return 0
    state = run.sharded.checkpoint_state(run.optimizer, for_load=True)
    step = ckpt.manager.load(found, state, run.scheduler, rank=run.rt.rank, world_size=run.rt.world_size,
                             device=run.rt.device)
    run.sharded.load_checkpoint_state(state, run.optimizer)
    if run.rt.is_main:
        print(f"resumed from {found} at step {step}", flush=True)
    return step


def _memory_tracker(enabled: bool, device: torch.device):
    if not enabled:
        return None
    from shardtune.memory import memory_tracker

    return memory_tracker(device).start()  # CPU: a dispatch mode over live storages (slows steps ~2-5x)
