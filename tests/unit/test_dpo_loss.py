"""Our DPO loss against TRL's own: `DPOTrainer._compute_loss` (TRL 1.16 keeps the loss inside it) run unbound on a
minimal stand-in trainer, with precomputed reference log-probs. Per-pair losses and rewards (one pair per TRL call)
and the gradients of the batch mean must agree.

Two levels. (1) The loss function, exact (1e-6, fp64): a stand-in model hands both sides the same per-token
log-probs, a leaf tensor, and the gradients are taken with respect to it. (2) The whole path on a real tiny model
in fp32, TRL patched with its fused LM head: TRL computes log-probs in fp32 in its own kernel (another summation
order), so a sum of ~6 token log-probs of ~-5 each agrees to its fp32 ulp (~2e-6): 1e-5 there."""
from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from shardtune.config.schema import ModelConfig
from shardtune.data.formats import IGNORE
from shardtune.model.build import build_model
from shardtune.trainer.dpo import pair_losses, sequence_logps

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

TOL = 1e-6
MODEL_TOL = 1e-5
PAIRS, SEQ = 3, 12
PROMPTS = [3, 5, 4]  # prompt tokens per pair
CHOSEN, REJECTED = [4, 6, 3], [5, 2, 7]  # response tokens per pair


def _batch():
    """Rows [chosen..., rejected...], right-padded; the completion mask marks response tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(2 * PAIRS, SEQ, dtype=torch.long)
    completion = torch.zeros_like(ids)
    for p in range(PAIRS):
        prompt = torch.randint(3, 128, (PROMPTS[p],), generator=g)
        for row, n in ((p, CHOSEN[p]), (PAIRS + p, REJECTED[p])):
            resp = torch.randint(3, 128, (n,), generator=g)
            ids[row, : PROMPTS[p] + n] = torch.cat([prompt, resp])
            completion[row, PROMPTS[p] : PROMPTS[p] + n] = 1
    attention = (torch.arange(SEQ) < torch.tensor(PROMPTS * 2)[:, None] +
                 torch.tensor(CHOSEN + REJECTED)[:, None]).long()
    noise = torch.randn(2 * PAIRS, generator=g)
    return ids, attention, completion, noise


def _model():
    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    model.config.use_cache = False
    return model


def _stand_in(model, loss: str, beta: float):
    ident = lambda x: x  # noqa: E731  (one process: gathers are the identity)
    acc = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=ident, gather=ident)
    return SimpleNamespace(model=model, accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss],
                           loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                           _total_train_tokens=0, _tp_size=1)


def _trl(model, rows, ids, attention, completion, ref, loss, beta):
    """TRL's batch-mean loss over the pairs `rows` (pair indices), and its mean rewards."""
    sel = rows + [PAIRS + r for r in rows]
    me = _stand_in(model, loss, beta)
    inputs = {"input_ids": ids[sel], "attention_mask": attention[sel], "completion_mask": completion[sel],
              "ref_chosen_logps": ref[rows], "ref_rejected_logps": ref[[PAIRS + r for r in rows]]}
    out = DPOTrainer._compute_loss(me, model, inputs, return_outputs=False)
    m = me._metrics["train"]
    return out, m["rewards/chosen"][-1], m["rewards/rejected"][-1]


def _swap(ids, attention, completion, ref):
    """The same pairs with chosen and rejected exchanged (TRL's loss at -delta)."""
    perm = list(range(PAIRS, 2 * PAIRS)) + list(range(PAIRS))
    return ids[perm], attention[perm], completion[perm], ref[perm]


CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.3, 0.0), ("hinge", 0.2, 0.0)]


class _LogProbModel(torch.nn.Module):
    """Returns fixed per-token log-probs (of the shifted labels), as TRL's fused head would."""

    def __init__(self, per_token: torch.Tensor) -> None:
        super().__init__()
        self.per_token = per_token

    def forward(self, input_ids, **_):
        rows = [int(r) for r in input_ids[:, 0]]  # column 0 carries the row id (see below)
        z = torch.zeros(len(rows), SEQ - 1, dtype=torch.float64)
        return SimpleNamespace(log_probs=self.per_token[rows], entropy=z, mean_logits=z, is_top1=z.bool())


@pytest.mark.parametrize("loss,beta,smooth", CASES)
def test_dpo_loss_function_matches_trl_exactly(loss, beta, smooth):
    ids, attention, completion, noise = _batch()
    ids[:, 0] = torch.arange(2 * PAIRS)
    g = torch.Generator().manual_seed(1)
    per_token = (-5 * torch.rand(2 * PAIRS, SEQ - 1, generator=g, dtype=torch.float64) * completion[:, 1:])
    per_token.requires_grad_(True)
    ref = per_token.detach().sum(1) + noise.double()
    model = _LogProbModel(per_token)
    model.train()

    mask = completion[:, 1:]
    ours = pair_losses(*(per_token.sum(1)).chunk(2), *ref.chunk(2), beta=beta, loss=loss, label_smoothing=smooth,
                       len_chosen=mask[:PAIRS].sum(1), len_rejected=mask[PAIRS:].sum(1))
    (ours_grad,) = torch.autograd.grad(ours.losses.mean(), per_token)

    swapped = _swap(ids, attention, completion, ref)
    for p in range(PAIRS):
        want, rc, rr = _trl(model, [p], ids, attention, completion, ref, loss, beta)
        if smooth:
            want = (1 - smooth) * want + smooth * _trl(model, [p], *swapped, loss, beta)[0]
        assert abs(ours.losses[p].item() - want.item()) < TOL
        assert abs(ours.reward_chosen[p].item() - rc) < TOL and abs(ours.reward_rejected[p].item() - rr) < TOL
    every = list(range(PAIRS))
    want = _trl(model, every, ids, attention, completion, ref, loss, beta)[0]
    if smooth:
        want = (1 - smooth) * want + smooth * _trl(model, every, *swapped, loss, beta)[0]
    (trl_grad,) = torch.autograd.grad(want, per_token)
    assert (ours_grad - trl_grad).abs().max().item() < TOL
    assert ours_grad.abs().max().item() > 1e-3  # not trivially zero


@pytest.mark.parametrize("loss,beta,smooth", CASES)
def test_dpo_on_a_model_matches_trl(loss, beta, smooth):
    ids, attention, completion, noise = _batch()
    ours_model = _model()
    trl_model = copy.deepcopy(ours_model)
    add_fused_lm_head(trl_model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trl_model.train()

    labels = ids.masked_fill(completion == 0, IGNORE)
    logps, lengths = sequence_logps(ours_model, ids, labels, torch.arange(SEQ).expand(2 * PAIRS, SEQ))
    ref = logps.detach() + noise  # a reference near the policy, as at the start of DPO (log-ratios ~1)
    out = pair_losses(logps[:PAIRS], logps[PAIRS:], ref[:PAIRS], ref[PAIRS:], beta=beta, loss=loss,
                      label_smoothing=smooth, len_chosen=lengths[:PAIRS], len_rejected=lengths[PAIRS:])
    out.losses.mean().backward()

    swapped = _swap(ids, attention, completion, ref)
    for p in range(PAIRS):  # one pair per call: TRL's batch mean is then the pair's own loss and reward
        want, rc, rr = _trl(trl_model, [p], ids, attention, completion, ref, loss, beta)
        if smooth:  # conservative DPO: (1 - eps) * L(delta) + eps * L(-delta), both from TRL
            want = (1 - smooth) * want + smooth * _trl(trl_model, [p], *swapped, loss, beta)[0]
        assert abs(out.losses[p].item() - want.item()) < MODEL_TOL
        assert abs(out.reward_chosen[p].item() - rc) < MODEL_TOL
        assert abs(out.reward_rejected[p].item() - rr) < MODEL_TOL

    trl_model.zero_grad()
    every = list(range(PAIRS))
    want = _trl(trl_model, every, ids, attention, completion, ref, loss, beta)[0]
    if smooth:
        want = (1 - smooth) * want + smooth * _trl(trl_model, every, *swapped, loss, beta)[0]
    want.backward()
    grads = dict(trl_model.named_parameters())
    worst = max((p.grad - grads[n].grad).abs().max().item() for n, p in ours_model.named_parameters())
    assert worst < MODEL_TOL, worst
    assert any(p.grad.abs().max() > 1e-3 for p in ours_model.parameters())  # the gradients are not all ~0
