"""GRPO (`train.objective: grpo`): online RL on `data.format: prompt` rows, TRL 1.16 GRPOTrainer's step.

Every `grpo.num_iterations` optimizer steps, at the step's start (`before_step`), each rank takes its prompts of the
global batch (the same world-size-free order and layout as SFT rows: rank r, micro-step a holds prompts
[(a*W + r)*b, +b)), so a prompt's whole group of `num_generations` completions lives on one rank, and:
  1. samples the completions with the current policy (trainer/sampling.py: keyed by (seed, generation round,
     prompt index), the same draws at any world size; forward batches of one micro-batch's prompts);
  2. decodes and scores them (trainer/rewards.py) and gathers the rewards and lengths of the whole step on the host
     group, so the advantages (trainer/grpo_loss.py, "batch" std included), the token count that dapo divides by
     and every logged figure are the global batch's on every rank;
  3. keeps the sampling policy's log-probs when num_iterations > 1 (the ratio's denominator) and the reference's
     when grpo.beta > 0 (the base with adapters off, as DPO's reference under LoRA; under full fine-tuning a frozen
     sharded copy of the starting weights, trainer/reference.py, built with the objective, a resume's included).
The optimizer steps of that round then run the clipped loss on those completions, one micro-batch of
b x num_generations rows per micro-step, each divided by the GLOBAL normalisers: 2 ranks train what 1 rank trains
(bnpo excepted: its token mean is per micro-batch by definition).

Rows are prompt + completion, right-padded: causal attention never lets a row read its padding, so no mask.
Log-probs are of logits / temperature, as TRL's. The whole logits of a micro-batch exist at once (fine for the
small vocabularies this runs on today; a chunked head is the next step for large ones).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardtune import accelerator
from shardtune.config import Recipe
from shardtune.data import GlobalBatches, TokenizedData
from shardtune.data.prompts import PromptRow, PromptRows
from shardtune.trainer.grpo_loss import group_advantages, policy_loss, stats_means
from shardtune.trainer.objective import SftObjective, adapters_disabled
from shardtune.trainer.reference import FrozenCopy, needs_frozen_copy
from shardtune.trainer.rewards import load_reward_funcs, score
from shardtune.trainer.runtime import Runtime, host_max
from shardtune.trainer.sampling import sample_completions

STATS = ("num_tokens", "clip_low_tokens", "clip_high_tokens", "clip_region_tokens", "kl_sum")
EVAL_SEED_STEP = 2**31 - 1  # the eval's sampling key step (greedy: no draw reads it; kept apart from training's)


@dataclass
class PromptMicroBatch:
    """A micro-step's prompts (indices into the split); the objective holds its completions."""
    micro: int  # the micro-step within the optimizer step
    prompt_ids: np.ndarray

    def to(self, device: torch.device) -> PromptMicroBatch:
        return self


class PromptBatches(GlobalBatches):
    """GlobalBatches over prompts; optimizer step k trains on generation round k // num_iterations."""

    def __init__(self, rows: PromptRows, *, num_iterations: int, **kwargs: Any) -> None:
        super().__init__(rows, **kwargs)
        self.num_iterations = num_iterations

    def step(self, step: int, rank: int) -> tuple[list[Any], int]:
        idx = self.indices(step // self.num_iterations)
        micro = [PromptMicroBatch(a, idx[(a * self.world + rank) * self.b:][:self.b]) for a in range(self.accum)]
        return micro, self.global_size


@dataclass
class Rollout:
    """One micro-step's completions, ready for the loss (on the device)."""
    input_ids: torch.Tensor  # [n, L] prompt + completion, right-padded
    mask: torch.Tensor  # [n, L - 1] completion targets of the shifted sequence
    advantages: torch.Tensor  # [n]
    old_logps: torch.Tensor | None  # [n, L - 1] (num_iterations > 1)
    ref_logps: torch.Tensor | None  # [n, L - 1] (beta > 0)


class GrpoObjective(SftObjective):
    norm_key = "prompts"
    batch_class = PromptBatches

    def __init__(self, recipe: Recipe, data: TokenizedData, rt: Runtime) -> None:
        super().__init__(recipe, data)
        from shardtune.model.build import build_tokenizer

        self.cfg = recipe.grpo
        self.rows_per_item = self.cfg.num_generations
        self.train_rows = PromptRows(data.entry, "train", data.manifest)
        self.eval_rows = PromptRows(data.entry, "eval", data.manifest)
        self.tok = build_tokenizer(recipe.model)
        self.funcs = load_reward_funcs(self.cfg.reward_funcs)
        self.step = 0
        self.rollouts: list[Rollout] = []
        self.norms: tuple[int, int] = (1, 1)  # (num_sequences, num_items_in_batch) of the step, global
        self.round_metrics: dict[str, float] = {}
        self._batches: PromptBatches | None = None
        # full fine-tuning with beta > 0: built here (collective), in the run's setup, not in a step
        self.reference = (FrozenCopy.build(recipe, device=rt.device, world_size=rt.world_size)
                          if needs_frozen_copy(recipe) else None)

    def batches(self, *, world_size: int) -> PromptBatches:
        t = self.recipe.train
        self._batches = PromptBatches(self.train_rows, num_iterations=self.cfg.num_iterations,
                                      micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                      world_size=world_size, seed=t.seed)
        return self._batches

    def first_full_step(self) -> int:
        """`plan --simulate` measures step 1: step 0 also samples the held-out "before" eval (greedy, one completion
        per prompt: a smaller generation than the step's own, and as many forwards again)."""
        return 1

    # --- generation round ---------------------------------------------------------------------------------------

    def before_step(self, model: nn.Module, rt: Runtime, run_dir: Path, step: int, *,
                    global_size: int) -> dict[str, float | torch.Tensor]:
        self.step = step
        out: dict[str, float | torch.Tensor] = {}
        if step == 0:  # the "before" figure of the held-out line
            out.update({k.replace("eval_", "start_eval_"): v for k, v in self.evaluate(model, rt,
                                                                                      global_size=global_size).items()})
        if step % self.cfg.num_iterations == 0 or not self.rollouts:  # a resumed run regenerates mid-round
            self._generate(model, rt, step)
        return {**out, **self.round_metrics}

    def _generate(self, model: nn.Module, rt: Runtime, step: int) -> None:
        cfg, t = self.cfg, self.recipe.train
        assert self._batches is not None, "batches() first"
        g, b = cfg.num_generations, t.micro_batch_size
        micro, _ = self._batches.step(step, rt.rank)
        rows = [r for mb in micro for r in self.train_rows.take(mb.prompt_ids)]
        ids = [int(i) for mb in micro for i in mb.prompt_ids]
        round_ = step // cfg.num_iterations
        t0 = time.perf_counter()
        completions = self._sample(model, rt, [r.ids for r in rows], [(t.seed, round_, i) for i in ids],
                                   num_generations=g, temperature=cfg.temperature, prompts_per_batch=b)
        gen_time = time.perf_counter() - t0
        total, per_func = self._score(rows, completions, g, step)
        lengths = [len(c) for c in completions]
        stops = set(self._stop_ids())
        clipped = [float(not c or c[-1] not in stops) for c in completions]  # TRL's: no EOS at the end
        # The step's figures over every rank, in the global batch's order (micro-step, then rank): the host group
        local = torch.tensor([total, *per_func.values(), clipped, lengths], dtype=torch.float64)  # [k, n]
        glob = _gather_global(local, world=rt.world_size, accum=t.grad_accum)  # [k, N]
        adv_all = group_advantages(glob[0], g, scale_rewards=cfg.scale_rewards)
        n_local = len(completions)
        mine = _local_slice(rt.rank, world=rt.world_size, accum=t.grad_accum, per_micro=n_local // t.grad_accum)
        advantages = adv_all[mine].float()
        self.norms = (glob.shape[1], int(glob[-1].sum()))
        self.round_metrics = _round_metrics(glob, list(per_func), g, gen_time, rt)
        self.rollouts = []
        per_micro = b * g
        for a in range(t.grad_accum):
            part = slice(a * per_micro, (a + 1) * per_micro)
            self.rollouts.append(self._rollout(model, rt, rows[a * b:(a + 1) * b], completions[part],
                                               advantages[part]))

    def _sample(self, model: nn.Module, rt: Runtime, prompt_ids: list[list[int]], keys: list[tuple[int, int, int]], *,
                num_generations: int, temperature: float, prompts_per_batch: int) -> list[list[int]]:
        was_training = model.training
        model.eval()
        cfg = self.cfg
        out = sample_completions(model, prompt_ids, keys=keys, num_generations=num_generations,
                                 max_new_tokens=cfg.max_new_tokens, temperature=temperature, top_p=cfg.top_p,
                                 top_k=cfg.top_k or None, stop_ids=self._stop_ids(), pad_id=self._pad_id(),
                                 world_size=rt.world_size, prompts_per_batch=prompts_per_batch, device=rt.device)
        model.train(was_training)
        return out

    def _stop_ids(self) -> list[int]:
        """EOS, and for chat prompts the chat template's end-of-turn token when it is one token."""
        ids = [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]
        end = getattr(self.tok, "chat_template", None) and _turn_end_id(self.tok)
        return ids + ([end] if end is not None and end not in ids else [])

    def _pad_id(self) -> int:
        pad = self.tok.pad_token_id
        return pad if pad is not None else (self.tok.eos_token_id or 0)

    def _score(self, rows: list[PromptRow], completions: list[list[int]], g: int,
               step: int) -> tuple[list[float], dict[str, list[float]]]:
        texts = self.tok.batch_decode(completions, skip_special_tokens=True)
        prompts = [r.prompt for r in rows for _ in range(g)]
        given = [[{"role": "assistant", "content": s}] if isinstance(p, list) else s for p, s in zip(prompts, texts)]
        names = sorted({k for r in rows for k in r.columns})
        columns = {k: [r.columns.get(k) for r in rows for _ in range(g)] for k in names}
        total, per_func = score(self.funcs, self.cfg.reward_weights, prompts, given, columns,
                                completion_ids=completions, step=step,
                                rows=[r.source_row + 1 for r in rows for _ in range(g)])
        # TRL: a completion no function scores is NaN; it takes no part in the advantages (0 here)
        return [0.0 if math.isnan(x) else x for x in total], {
            k: [0.0 if math.isnan(x) else x for x in v] for k, v in per_func.items()}

    @torch.no_grad()
    def _rollout(self, model: nn.Module, rt: Runtime, rows: list[PromptRow], completions: list[list[int]],
                 advantages: torch.Tensor) -> Rollout:
        g = self.cfg.num_generations
        seqs = [rows[i // g].ids + c for i, c in enumerate(completions)]
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self._pad_id(), dtype=torch.long)
        mask = torch.zeros(len(seqs), length - 1)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            p = len(rows[i // g].ids)
            mask[i, p - 1:len(s) - 1] = 1.0  # target position j predicts token j + 1: the completion's tokens
        ids, mask, advantages = (accelerator.to_device(x, rt.device) for x in (ids, mask, advantages))
        old = ref = None
        if self.cfg.num_iterations > 1:
            old = self._token_logps(model, ids)
        if self.cfg.beta > 0 and self.reference is not None:
            ref = self.reference.logps(self._token_logps, ids)
        elif self.cfg.beta > 0:
            with adapters_disabled(model):
                ref = self._token_logps(model, ids)
        return Rollout(ids, mask, advantages, old, ref)

    def _token_logps(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """[n, L - 1] log-probability of each next token under softmax(logits / temperature), fp32 at least."""
        n, length = ids.shape
        pos = accelerator.to_device(torch.arange(length).expand(n, length).contiguous(), ids.device)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False,
                       doc_lengths=((length,),) * n).logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / self.cfg.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    # --- the step's loss ----------------------------------------------------------------------------------------

    def micro_loss(self, model: nn.Module, mb: Any, norm: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(mb, PromptMicroBatch)
        r = self.rollouts[mb.micro]
        cfg = self.cfg
        logps = self._token_logps(model, r.input_ids)
        num_sequences, num_items = self.norms
        loss, stats = policy_loss(logps, r.old_logps, r.ref_logps, r.advantages, r.mask, loss_type=cfg.loss_type,
                                  epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_upper, beta=cfg.beta,
                                  max_completion_length=cfg.max_new_tokens, num_items_in_batch=num_items,
                                  num_sequences=num_sequences)
        zero = loss.new_zeros((), dtype=torch.float64)
        return loss, torch.stack([stats.get(k, zero).detach().double() for k in STATS])

    def metrics(self, sums: list[float], norm: int) -> dict[str, float]:
        means = stats_means(dict(zip(STATS, sums)))
        if self.cfg.beta == 0:
            means.pop("kl", None)
        return {k: float(v) for k, v in means.items()}

    # --- held-out reward ----------------------------------------------------------------------------------------

    def evaluate(self, model: nn.Module, rt: Runtime, *, global_size: int) -> dict[str, float]:
        """Greedy completions of held-out prompts (train.eval_batches x the global batch at most), scored by the
        reward functions: eval_reward (the weighted total) and eval_reward/<function>, means over the prompts."""
        n = min(len(self.eval_rows), self.recipe.train.eval_batches * global_size)
        if n == 0:
            return {}
        b = self.recipe.train.micro_batch_size
        per_rank = math.ceil(n / rt.world_size)
        idx = list(range(rt.rank * per_rank, min(n, (rt.rank + 1) * per_rank)))
        rows = self.eval_rows.take(np.array(idx, dtype=np.int64)) if idx else []
        completions = self._sample(model, rt, [r.ids for r in rows], [(0, EVAL_SEED_STEP, i) for i in idx],
                                   num_generations=1, temperature=0.0, prompts_per_batch=b)
        total, per_func = self._score(rows, completions, 1, self.step) if rows else ([], {f.name: [] for f in self.funcs})
        sums = torch.tensor([sum(total), *(sum(v) for v in per_func.values())], dtype=torch.float64)
        dist.all_reduce(sums, group=accelerator.host_group())
        means = (sums / n).tolist()
        return {"eval_reward": means[0], **{f"eval_rewards/{k}": v for k, v in zip(per_func, means[1:])}}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The held-out mean of the first reward function (and of the total) before training and at the last eval."""
        first = f"rewards/{self.funcs[0].name}"
        start = [r for r in history if "start_eval_reward" in r]
        evals = [r for r in history if "eval_reward" in r]
        return {"reward_function": self.funcs[0].name,
                "eval_reward_start": start[0]["start_eval_reward"] if start else None,
                "eval_reward_after": evals[-1]["eval_reward"] if evals else None,
                "held_out_start": start[0].get(f"start_eval_{first}") if start else None,
                "held_out_after": evals[-1].get(f"eval_{first}") if evals else None}

    def print_summary(self, summary: dict[str, Any]) -> None:
        a, b = summary["held_out_start"], summary["held_out_after"]
        if a is not None and b is not None:
            print(f"held-out {summary['reward_function']} (greedy): before {a:.1%} -> after {b:.1%}", flush=True)


def _turn_end_id(tok: Any) -> int | None:
    sentinel = "\x00reply\x00"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001 (a template with rules of its own: EOS alone ends a completion)
        return None
    after = text.split(sentinel, 1)[1].strip() if sentinel in text else ""
    ids = tok.encode(after, add_special_tokens=False) if after else []
    return ids[0] if len(ids) == 1 else None


def _gather_global(local: torch.Tensor, *, world: int, accum: int) -> torch.Tensor:
    """[k, n] per-completion host figures of this rank -> [k, N] of the step in global order: micro-step a of rank
    r holds global positions [(a*W + r) * n/accum, +n/accum)."""
    if world == 1:
        return local
    host_group = accelerator.host_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(host_group))]
    dist.all_gather(parts, local, group=host_group)
    if len(parts) == 1:  # plan --simulate: rank 0 stands alone for the world (its host group is itself), as its peers
        parts *= world
    k, n = local.shape
    stacked = torch.stack(parts).view(world, k, accum, n // accum)  # [W, k, A, m]
    return stacked.permute(1, 2, 0, 3).reshape(k, world * n)


def _local_slice(rank: int, *, world: int, accum: int, per_micro: int) -> torch.Tensor:
    """This rank's positions in the global order (its micro-steps' completions, in order)."""
    return torch.cat([torch.arange((a * world + rank) * per_micro, (a * world + rank + 1) * per_micro)
                      for a in range(accum)])


def _round_metrics(glob: torch.Tensor, names: list[str], g: int, gen_time: float, rt: Runtime) -> dict[str, float]:
    """TRL's logged names, over the global batch ([total, *per function, clipped, length] x completions): reward,
    reward_std, rewards/<f>/mean|std, frac_reward_zero_std, completions/mean|min|max_length,
    completions/clipped_ratio (no stop token at the end); plus generation tokens/s (all ranks' tokens over the
    slowest rank's sampling time)."""
    total, clipped, lengths = glob[0], glob[-2], glob[-1]
    std = lambda x: float(x.std()) if x.numel() > 1 else 0.0  # noqa: E731
    out = {"reward": float(total.mean()), "reward_std": std(total)}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(glob[1 + i].mean())
        out[f"rewards/{name}/std"] = std(glob[1 + i])
    groups = total.view(-1, g)
    out["frac_reward_zero_std"] = float((groups.std(dim=1) < 1e-12).double().mean())
    out.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(clipped.mean())})
    slowest = gen_time if rt.world_size == 1 else host_max(gen_time)
    out["gen_tokens_per_s"] = float(lengths.sum()) / max(slowest, 1e-9)
    return out
