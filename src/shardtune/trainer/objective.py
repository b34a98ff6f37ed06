"""What one training step optimises: `train.objective` sft (next-token loss) or dpo (preference pairs).

The step (trainer/train.py) asks its objective for the global batches, one loss per micro-batch (already divided by the
global batch's normaliser, so the sum over ranks and micro-steps is the global mean at any world size x
grad_accum), a few summed statistics (all-reduced once per step with the loss), and the eval metrics.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardtune import accelerator
from shardtune.config import Recipe
from shardtune.data import GlobalBatches, TokenizedData
from shardtune.data.batches import MicroBatch
from shardtune.data.preference import PairBatches, PairMicroBatch, PairRows
from shardtune.engine.loss import token_loss_sum
from shardtune.errors import UserError
from shardtune.trainer.dpo import pair_losses, sequence_logps
from shardtune.trainer.evaluate import eval_loss
from shardtune.trainer.runtime import Runtime

REFERENCE_FILE = "dpo_reference.npz"  # precomputed reference log-probs, in the run dir (read back on resume)


class SftObjective:
    norm_key = "target_tokens"  # what the micro-losses are divided by (in metrics.jsonl)
    rows_per_item = 1
    batch_class: type[GlobalBatches] = GlobalBatches

    def __init__(self, recipe: Recipe, data: TokenizedData) -> None:
        self.recipe, self.data = recipe, data
        self._router = None  # RouterBalance, attached on the first micro-step when router_aux_loss_coef > 0

    def batches(self, *, world_size: int) -> GlobalBatches:
        t = self.recipe.train
        return self.batch_class(self.data.train, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                world_size=world_size, seed=t.seed)

    def before_step(self, model: nn.Module, rt: Runtime, run_dir: Path, step: int, *,
                    global_size: int) -> dict[str, float | torch.Tensor]:
        """Work at the start of optimizer step `step` (0-based), on every rank; metrics for its record (SFT: none),
        floats or 0-d device tensors (read with the step's one host read)."""
        return {}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Extra summary.json entries from the run's records (rank 0's; SFT: none)."""
        return {}

    def print_summary(self, summary: dict[str, Any]) -> None:
        pass

    def micro_loss(self, model: nn.Module, mb: MicroBatch, norm: int) -> tuple[torch.Tensor, torch.Tensor]:
        coef = self.recipe.train.router_aux_loss_coef
        if coef and self._router is None:
            from shardtune.model.router_loss import RouterBalance

            self._router = RouterBalance(model)
        if self._router is not None:
            self._router.start()
        loss = token_loss_sum(model, mb.input_ids, mb.labels, mb.position_ids,
                              chunk_tokens=self.recipe.train.loss_chunk_tokens, doc_lengths=mb.doc_lengths) / norm
        if self._router is not None:
            loss = loss + coef * self._router.loss(mb.input_ids.shape[0], norm)
        return loss, loss.new_zeros(0)

    def first_full_step(self) -> int:
        """The first step that runs the objective whole (`plan --simulate` measures it): SFT's first."""
        return 0

    def metrics(self, sums: list[float], norm: int) -> dict[str, float]:
        return {}

    def evaluate(self, model: nn.Module, rt: Runtime, *, global_size: int) -> dict[str, float]:
        t = self.recipe.train
        ev = eval_loss(model, self.data.eval, rt, micro_batch_size=t.micro_batch_size,
                       max_rows=t.eval_batches * global_size, loss_chunk_tokens=t.loss_chunk_tokens)
        return {} if ev is None else {"eval_loss": ev}


@contextmanager
def adapters_disabled(model: nn.Module):
    """The LoRA model without its adapters = the frozen base = DPO's reference.

    Each peft layer's own switch flag (what its forward reads), not peft's `enable_adapters`: that also sets
    `requires_grad` on the adapter parameters a layer holds at that moment, and under FSDP2 (engine.backend=torch)
    both parts of it go wrong. FSDP2 reads which parameters train at its lazy init, in the first forward: when that
    is the reference forward, no parameter trains, its reduce dtype is left unset, and the adapters' bf16 gradients
    are then assigned to their fp32 shards unreduced in fp32 (an error at one rank). And on a unit the forward leaves
    gathered (shard_grad_op), putting the flags back reaches the unsharded parameters, not the sharded ones FSDP2
    and the optimizer treat as the truth. `requires_grad` is never touched here; the reference forward runs under
    no_grad."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "adapters_disabled needs a LoRA model"
    for m in layers:
        m._disable_adapters = True  # peft's `disable_adapters` property reads it
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


class DpoObjective(SftObjective):
    """DPO. One forward of the 2b rows (b chosen, then b rejected) per micro-step, so each unit is gathered once
    for the policy; the reference is either a no-grad forward of the same rows with the adapters off (LoRA), or a
    table computed when DPO starts (`precompute_reference`). Normaliser: the G pairs of the global batch.

    `dpo.sft_warmup_steps` N: steps 1..N are SFT on the chosen responses (per-pair mean token NLL, / G); the
    reference is then computed from the warmed-up weights before step N + 1, and DPO runs from there."""

    norm_key = "pairs"
    rows_per_item = 2
    batch_class = PairBatches
    STATS = ("dpo_loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, recipe: Recipe, data: TokenizedData) -> None:
        super().__init__(recipe, data)
        self.cfg = recipe.dpo
        pre = self.cfg.precompute_reference
        self.warmup = self.cfg.sft_warmup_steps
        self.precompute = (not recipe.lora.enabled or self.warmup > 0) if pre is None else pre
        self.step = 0
        self.train_pairs, self.eval_pairs = PairRows(data.train), PairRows(data.eval)
        self.reference: dict[str, np.ndarray] = {}  # split -> [pairs, 2] float64 (chosen, rejected)

    def before_step(self, model: nn.Module, rt: Runtime, run_dir: Path, step: int, *,
                    global_size: int) -> dict[str, float | torch.Tensor]:
        """Where DPO starts (step == sft_warmup_steps): the reference log-probs when precomputed, and one eval of
        the held-out pairs: `start_eval_*`, the "before" figures (policy = reference: reward accuracy 50 %)."""
        self.step = step
        if step != self.warmup and not (self.precompute and not self.reference and step > self.warmup):
            return {}
        if self.precompute:
            self._load_or_compute_reference(model, rt, run_dir, step)
        if step > self.warmup:  # resumed mid-DPO: the start was measured by the first run
            return {}
        before = self._eval_on_device(model, rt, global_size=global_size)  # read with the step's loss
        return {k.replace("eval_", "start_eval_"): v for k, v in before.items()}

    def _load_or_compute_reference(self, model: nn.Module, rt: Runtime, run_dir: Path, step: int) -> None:
        path = run_dir / REFERENCE_FILE
        if step > self.warmup:  # a resumed run: the weights are no longer the ones the reference was taken from
            if not path.exists():
                raise UserError(f"train.resume: {path} is missing: the precomputed DPO reference of this run is "
                                "needed to resume it; start the run again from step 0 (train.resume=none)")
            with np.load(path) as f:
                self.reference = {k: f[k] for k in f.files}
            have = {k: len(v) for k, v in self.reference.items()}
            want = {"train": len(self.train_pairs), "eval": len(self.eval_pairs)}
            if have != want:  # other data under train.resume=force
                raise UserError(f"train.resume: {path} holds reference log-probs of other pairs ({have} vs {want}): "
                                "a precomputed reference cannot continue on other data; start the run again (new "
                                "train.output_dir)")
            return
        for split, rows in (("train", self.train_pairs), ("eval", self.eval_pairs)):
            self.reference[split] = _precompute(model, rows, rt, self.recipe.train.micro_batch_size)
        if rt.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            tmp = run_dir / (REFERENCE_FILE + ".tmp.npz")
            np.savez(tmp, **self.reference)
            tmp.replace(path)

    def _pair_out(self, model: nn.Module, mb: PairMicroBatch, split: str):
        b = len(mb.pair_ids)
        if self.precompute:
            ref = accelerator.to_device(torch.from_numpy(self.reference[split][mb.pair_ids]).float(),
                                        mb.input_ids.device)
            ref_c, ref_r = ref[:, 0], ref[:, 1]
        else:  # before the policy forward: the engine's step state then sees forward -> backward as usual
            with torch.no_grad(), adapters_disabled(model):
                ref_logps, _ = sequence_logps(model, mb.input_ids, mb.labels, mb.position_ids)
            ref_c, ref_r = ref_logps[:b], ref_logps[b:]
        logps, lengths = sequence_logps(model, mb.input_ids, mb.labels, mb.position_ids)
        return pair_losses(logps[:b], logps[b:], ref_c, ref_r, beta=self.cfg.beta, loss=self.cfg.loss,
                           label_smoothing=self.cfg.label_smoothing, len_chosen=lengths[:b], len_rejected=lengths[b:])

    def micro_loss(self, model: nn.Module, mb: MicroBatch, norm: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(mb, PairMicroBatch)
        if self.step < self.warmup:  # SFT warm-up: the chosen rows only
            b = len(mb.pair_ids)
            logps, lengths = sequence_logps(model, mb.input_ids[:b], mb.labels[:b], mb.position_ids[:b])
            loss = -(logps / lengths.clamp(min=1)).sum() / norm
            return loss, loss.new_zeros(0)
        out = self._pair_out(model, mb, "train")
        return out.losses.sum() / norm, _sums(out)

    def first_full_step(self) -> int:
        """After the SFT warm-up: the first DPO step, its reference log-probs standing as zeros when precomputed
        (the pass over every pair that makes them is no part of a step's peak)."""
        if not self.warmup:
            return 0
        if self.precompute:
            self.reference = {split: np.zeros((len(rows), 2))
                              for split, rows in (("train", self.train_pairs), ("eval", self.eval_pairs))}
        return self.warmup + 1

    def metrics(self, sums: list[float], norm: int) -> dict[str, float]:
        if self.step < self.warmup:
            return {"phase": "sft_warmup"}
        return {k: v / norm for k, v in zip(self.STATS, sums)}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Held-out reward accuracy where DPO started (this run's records) and at the last eval."""
        start = [r["start_eval_reward_accuracy"] for r in history if "start_eval_reward_accuracy" in r]
        evals = [r["eval_reward_accuracy"] for r in history if "eval_reward_accuracy" in r]
        return {"reward_accuracy_start": start[0] if start else None,
                "reward_accuracy_after": evals[-1] if evals else None}

    def print_summary(self, summary: dict[str, Any]) -> None:
        a, b = summary["reward_accuracy_start"], summary["reward_accuracy_after"]
        if b is not None:
            start = f"{a:.1%} where DPO started (policy = reference)" if a is not None else "(start not in this run)"
            print(f"held-out reward accuracy: {start} -> {b:.1%} after", flush=True)

    def evaluate(self, model: nn.Module, rt: Runtime, *, global_size: int) -> dict[str, float]:
        """DPO loss and rewards on held-out pairs (one host read)."""
        stats = self._eval_on_device(model, rt, global_size=global_size)
        if not stats:
            return {}
        return dict(zip(stats, accelerator.to_host(torch.stack(list(stats.values()))).tolist()))  # simulated: zeros

    @torch.no_grad()
    def _eval_on_device(self, model: nn.Module, rt: Runtime, *, global_size: int) -> dict[str, torch.Tensor]:
        """`evaluate`'s figures as 0-d device tensors, summed over the ranks, not read: every rank runs the same
        number of forwards (weight-0 dummies)."""
        n = min(len(self.eval_pairs), self.recipe.train.eval_batches * global_size)
        if n == 0 or self.step < self.warmup:  # no reference yet
            return {}
        was_training = model.training
        model.eval()
        b = self.recipe.train.micro_batch_size
        total = torch.zeros(len(self.STATS), dtype=torch.float64, device=rt.device)
        for idx, weight in _rank_chunks(n, b, rt):
            mb = self.eval_pairs.micro_batch(idx).to(rt.device)
            total += weight * _sums(self._pair_out(model, mb, "eval"))
        model.train(was_training)
        dist.all_reduce(total)
        out = {f"eval_{k}": v / n for k, v in zip(self.STATS, total.unbind())}
        out["eval_loss"] = out.pop("eval_dpo_loss")  # the key the progress line and loss.png read
        return out


def _sums(out) -> torch.Tensor:
    """Summed statistics of a micro-batch, in STATS order. Reward accuracy counts ties (as at step 0, when the
    policy is the reference) as half: an untrained policy scores 50 %, not 0 % (TRL counts ties as wrong)."""
    rc, rr = out.reward_chosen, out.reward_rejected
    acc = (rc > rr).double() + 0.5 * (rc == rr).double()
    return torch.stack([out.losses.detach().double().sum(), rc.double().sum(), rr.double().sum(),
                        (rc - rr).double().sum(), acc.sum()])


def _rank_chunks(n: int, b: int, rt: Runtime):
    """This rank's pair indices per forward over pairs [0, n), with weight 0 for the padding forwards."""
    for start in range(0, n, b * rt.world_size):
        idx = np.arange(start + rt.rank * b, min(start + (rt.rank + 1) * b, n))
        yield (idx, 1.0) if len(idx) else (np.array([0]), 0.0)


@torch.no_grad()
def _precompute(model: nn.Module, rows: PairRows, rt: Runtime, b: int) -> np.ndarray:
    """Reference log-probs of every pair of a split with the current (initial) weights, on all ranks."""
    was_training = model.training
    model.eval()
    # Filled on the device and read once (a read per forward would stall the CPU each time)
    table = torch.zeros(len(rows), 2, dtype=torch.float64, device=rt.device)
    for idx, weight in _rank_chunks(len(rows), b, rt):
        mb = rows.micro_batch(idx).to(rt.device)
        logps, _ = sequence_logps(model, mb.input_ids, mb.labels, mb.position_ids)
        if weight:
            table[accelerator.to_device(torch.from_numpy(idx), rt.device)] = logps.view(2, -1).t().double()
    model.train(was_training)
    if rt.world_size > 1:  # each pair was computed by exactly one rank
        dist.all_reduce(table)
    return accelerator.to_host(table).numpy()
