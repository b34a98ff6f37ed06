"""The training worker: one process per rank, started by torchrun (see launch.py). Reads top to bottom."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import get_scheduler

from shardtune.config import Recipe
from shardtune.data import GlobalBatches, build_data
from shardtune.evaluate import eval_loss, exact_match, token_loss_sum
from shardtune.export import save_final
from shardtune.metrics import MetricsLog
from shardtune.model import build_model, build_tokenizer
from shardtune.parallelize import parallelize
from shardtune.runtime import all_reduce_max, all_reduce_sum, init_runtime


def train(recipe: Recipe) -> dict:
    rt = init_runtime(recipe.launch)
    cfg = recipe.train
    run_dir = Path(cfg.output_dir)
    tok = build_tokenizer(recipe.model)
    data = build_data(recipe.data, tok, seed=cfg.seed)
    model = build_model(recipe.model, seed=cfg.seed, device=rt.device)
    sharded = parallelize(model, recipe, device=rt.device, world_size=rt.world_size)
    optimizer = torch.optim.AdamW(sharded.optimizer_param_groups(cfg.weight_decay), lr=cfg.lr,
                                  betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(cfg.schedule, optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=cfg.max_steps)
    batches = GlobalBatches(data.train, micro_batch_size=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                            world_size=rt.world_size, seed=cfg.seed)
    log = MetricsLog(run_dir, max_steps=cfg.max_steps, enabled=rt.is_main)
    tracker = _memory_tracker(cfg.profile_memory, rt.device)
    demo = data.eval_raw[: cfg.demo_eval_samples] if cfg.demo_eval else []
    acc_before = exact_match(model, tok, demo, rt) if demo else None

    model.train()
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        comm0 = sharded.comm_bytes()
        if tracker is not None:
            tracker.reset_peak()
        micro_batches, num_targets = batches.step(step, rt.rank)
        loss_sum = 0.0
        for i, mb in enumerate(micro_batches):
            mb = mb.to(rt.device)
            # Reduce gradients on every micro-step, or only on the last one (unsharded grads kept meanwhile).
            sharded.set_requires_gradient_sync(recipe.engine.sync_every_microstep or i == len(micro_batches) - 1)
            # Divide by the global target count: the sum over ranks and micro-steps is the global mean loss.
            loss = token_loss_sum(model, mb.input_ids, mb.labels, mb.position_ids) / num_targets
            loss.backward()
            loss_sum += loss.item()  # a sync point, once per micro-step
        grad_norm = sharded.clip_grad_norm_(cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0
        (loss_global,) = all_reduce_sum([loss_sum], rt.device)
        tokens = batches.global_size * recipe.data.seq_len
        record = {"step": step + 1, "loss": loss_global, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": float(grad_norm), "tokens": tokens, "target_tokens": num_targets,
                  "tokens_per_s": tokens / step_time, "step_time_s": step_time,
                  "comm_bytes": sharded.comm_bytes() - comm0 if comm0 >= 0 else None}
        if tracker is not None:
            record["peak_mem_bytes"] = int(all_reduce_max(tracker.peak_bytes(), rt.device))
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
            ev = eval_loss(model, data.eval, rt, micro_batch_size=cfg.micro_batch_size,
                           max_rows=cfg.eval_batches * batches.global_size)
            if ev is not None:
                record["eval_loss"] = ev
        log.log(record)

    acc_after = exact_match(model, tok, demo, rt) if demo else None
    if cfg.save_final:
        save_final(sharded, model, tok, run_dir / "final", is_main=rt.is_main)
    log.close(run_dir)
    summary = {"final_loss": log.history[-1]["loss"] if log.history else None,
               "accuracy_before": acc_before, "accuracy_after": acc_after}
    if rt.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_summary(log.history, acc_before, acc_after)
    return summary


def _memory_tracker(enabled: bool, device: torch.device):
    if not enabled:
        return None
    from shardtune.memory import memory_tracker

    return memory_tracker(device).start()  # CPU: a dispatch mode over live storages (slows steps ~2-5x)


def _print_summary(history: list[dict], acc_before: float | None, acc_after: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="loss")
    for col in ("step", "loss", "eval_loss", "tokens/s"):
        table.add_column(col, justify="right")
    picks = sorted({0, len(history) // 4, len(history) // 2, 3 * len(history) // 4, len(history) - 1})
    for i in picks:
        if 0 <= i < len(history):
            r = history[i]
            ev = f"{r['eval_loss']:.4f}" if "eval_loss" in r else ""
            table.add_row(str(r["step"]), f"{r['loss']:.4f}", ev, f"{r['tokens_per_s']:.0f}")
    console = Console()
    console.print(table)
    if acc_before is not None:
        console.print(f"held-out exact-match accuracy: before {acc_before:.1%} -> after {acc_after:.1%}")
