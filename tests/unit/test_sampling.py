"""GRPO's sampling (trainer/sampling.py): the draws depend on (seed, step, prompt id, generation, position) only, not
on the batch a prompt lands in; greedy at temperature 0 or top_k=1; the pick function's support and weights against
transformers' warpers; stop ids end a row. The 2-rank case: tests/distributed/test_sampling_ranks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shardtune.config.schema import ModelConfig
from shardtune.model.build import build_model
from shardtune.trainer.decode import greedy_decode
from shardtune.trainer.sampling import pick_tokens, sample_completions, uniforms

PROMPTS = [[5, 9, 17, 3], [44, 2, 90, 91, 7, 8, 12], [100], [33, 34, 35, 36, 37]]  # 2 is tiny-llama's EOS
KEYS = [(7, 3, 10 + i) for i in range(len(PROMPTS))]
KW = {"num_generations": 3, "max_new_tokens": 12, "temperature": 1.0, "stop_ids": [], "pad_id": 0, "device": "cpu"}


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0).eval()


def test_the_same_prompt_draws_the_same_completions_in_any_batch(model):
    """All prompts in one batch, one prompt per batch, the prompts in another order with other keys' neighbours:
    the same completions. Batches of the same prompts are the same bits (logprobs equal); across batch shapes the
    logits move in the last bit (module docstring), the completions do not."""
    one, lp_one = sample_completions(model, PROMPTS, keys=KEYS, logprobs=True, **KW)
    singles, lp_singles = sample_completions(model, PROMPTS, keys=KEYS, prompts_per_batch=1, logprobs=True, **KW)
    halves = [sample_completions(model, PROMPTS[h:h + 2], keys=KEYS[h:h + 2], prompts_per_batch=1, **KW)
              for h in (0, 2)]
    back = sample_completions(model, PROMPTS[::-1], keys=KEYS[::-1], **KW)
    assert len(one) == len(PROMPTS) * 3 and all(len(c) == 12 for c in one)
    assert singles == one and halves[0] + halves[1] == one
    assert [c for i in range(len(PROMPTS) - 1, -1, -1) for c in back[3 * i:3 * i + 3]] == one
    again = sample_completions(model, PROMPTS[1:2], keys=KEYS[1:2], prompts_per_batch=1, logprobs=True, **KW)
    assert again[1] == lp_singles[3:6]  # bit for bit: the same batch wherever it runs
    assert np.allclose(np.array(lp_one), np.array(lp_singles), atol=1e-5)
    # the randomness is the key's: another step, prompt id or seed draws otherwise, a prompt's generations differ
    other = sample_completions(model, PROMPTS, keys=[(7, 4, k[2]) for k in KEYS], **KW)
    assert other != one and len({tuple(c) for c in one[:3]}) == 3


def test_temperature_zero_and_top_k_1_are_greedy(model):
    ids = torch.zeros(len(PROMPTS), 7, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, 7 - len(p):], mask[i, 7 - len(p):] = torch.tensor(p), 1
    greedy = greedy_decode(model, ids, mask, max_new_tokens=12, pad_token_id=0)[:, 7:].tolist()
    want = [g for g in greedy for _ in range(2)]
    kw = {**KW, "num_generations": 2}
    assert sample_completions(model, PROMPTS, keys=KEYS, **{**kw, "temperature": 0.0}) == want
    assert sample_completions(model, PROMPTS, keys=KEYS, top_k=1, **{**kw, "temperature": 1.7}) == want


def test_a_stop_id_ends_the_row_and_pads_after(model):
    free = sample_completions(model, PROMPTS, keys=KEYS, **KW)
    stop = free[4][5]  # prompt 1, generation 1: its sixth token becomes a stop
    got = sample_completions(model, PROMPTS, keys=KEYS, **{**KW, "stop_ids": [stop, 2]})
    for f, g in zip(free, got, strict=True):
        n = next((i + 1 for i, t in enumerate(f) if t in (stop, 2)), len(f))
        assert g == f[:n]  # the same draws up to and including the first stop, nothing after it
    assert got[4] == free[4][:free[4].index(stop) + 1] and len(got[4]) <= 6
    # the tokens the loop returns: pad (0) after the stop
    from shardtune.trainer.sampling import _sample_batch

    tokens, _ = _sample_batch(model, PROMPTS[1:2], KEYS[1:2], num_generations=3, max_new_tokens=12, temperature=1.0,
                              top_p=1.0, top_k=None, stop_ids=[stop, 2], pad_id=0, world_size=1,
                              device=torch.device("cpu"), logprobs=False)
    n = len(got[4])
    assert tokens[1, :n].tolist() == got[4] and (tokens[1, n:] == 0).all()


def test_all_rows_stopping_stops_the_forwards(model):
    first = sample_completions(model, PROMPTS[:1], keys=KEYS[:1], **{**KW, "num_generations": 1})[0][0]
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        got = sample_completions(model, PROMPTS[:1], keys=KEYS[:1], **{**KW, "num_generations": 1, "stop_ids": [first]})
    finally:
        handle.remove()
    assert got == [[first]] and len(calls) == 1


def _reference(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """transformers' sampling distribution: its warpers in generate's order, then softmax."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.5, None, 1.0), (2.0, None, 1.0),
                                                     (1.0, 5, 1.0), (0.7, None, 0.8), (1.3, 12, 0.6),
                                                     (1.0, None, 0.05)])
def test_pick_draws_transformers_distribution(temperature, top_k, top_p):
    """u on a grid of N points: each token is picked for a share of u equal to its probability (within 1/N), zero
    outside the top-k / top-p support, and the temperature's distribution, not the untempered one."""
    n = 20_000
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 2
    want = _reference(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    picks = pick_tokens(logits.repeat_interleave(n, 0), u.repeat(3), temperature=temperature, top_k=top_k, top_p=top_p)
    freq = torch.stack([torch.bincount(r, minlength=40) for r in picks.view(3, n)]).float() / n
    assert not (freq[want == 0] > 0).any()  # nothing outside the support...
    assert (freq[want > 2 / n] > 0).all()  # ...and all of it the grid can see
    assert (freq - want).abs().max() <= 2 / n
    if temperature != 1.0:
        assert (freq - _reference(logits, temperature=1.0, top_k=top_k, top_p=top_p)).abs().max() > 0.01
    if top_k:
        assert int((freq > 0).sum(-1).max()) <= top_k


def test_pick_inverse_cdf_edges():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    # vocabulary order: u just below / above the first token's mass
    assert pick_tokens(logits, torch.tensor([float(p[0]) * 0.999]), temperature=1.0).item() == 0
    assert pick_tokens(logits, torch.tensor([float(p[0]) * 1.001]), temperature=1.0).item() == 1
    # u at its largest (1 - 2^-24) with top_p: never a filtered token
    top = pick_tokens(logits, torch.tensor([1 - 2 ** -24]), temperature=1.0, top_p=0.5)
    assert top.item() == 2  # token 2 alone has mass 0.64 >= 0.5
    assert pick_tokens(logits, torch.tensor([0.0]), temperature=0.0).item() == 2


def test_uniforms_depend_on_the_key_and_position_only():
    a = uniforms(1, 2, 3, 4, 10)
    assert a.dtype == np.float32 and ((a >= 0) & (a < 1)).all()
    assert np.array_equal(uniforms(1, 2, 3, 4, 4), a[:4])  # token t's number whatever the budget
    for other in [(0, 2, 3, 4), (1, 0, 3, 4), (1, 2, 0, 4), (1, 2, 3, 0)]:
        assert not np.array_equal(uniforms(*other, 10), a)


@pytest.mark.parametrize("kw,message", [
    ({"keys": [(1, 2, 3)]}, "sampling: 1 keys for 4 prompts (one (seed, step, prompt id) each)"),
    ({"keys": [(1, -2, 3)] * 4}, "sampling: a key is (seed, step, prompt id), three non-negative integers"),
    ({"top_p": 0.0}, "sampling: top_p=0.0 is out of range"),
    ({"temperature": -1.0}, "sampling: temperature=-1.0 is out of range"),
])
def test_bad_arguments_are_one_line(model, kw, message):
    with pytest.raises(ValueError) as e:
        sample_completions(model, PROMPTS, **{**KW, "keys": KEYS, **kw})
    assert str(e.value) == message


def test_on_the_simulated_gpu_forwards_are_bounded_by_max_new_tokens():
    """The trainer's model on the simulated GPU, whose reads are zeros (never a stop): max_new_tokens forwards, one
    early-stop read per token but the last, one read of the completions; every pick runs on the device's meta
    kernels (top-k, top-p, searchsorted)."""
    import tempfile

    from shardtune import accelerator
    from shardtune.config.load import load_recipe
    from shardtune.plan.simulate import _simulated_world
    from shardtune.trainer.train import setup

    with tempfile.TemporaryDirectory() as tmp, _simulated_world(1, 1):
        run = setup(load_recipe("tiny-cpu", ["launch.device=cuda", f"train.output_dir={tmp}"]), simulated=True)
        forwards = []
        run.model.register_forward_hook(lambda *_: forwards.append(1))
        accelerator.TRACE.clear()
        out = sample_completions(run.model, [[5, 6, 7], [8, 9]], keys=KEYS[:2], num_generations=2, max_new_tokens=5,
                                 temperature=1.0, top_p=0.9, top_k=20, stop_ids=[2], pad_id=0, device=run.rt.device)
        reads = [s[1] for s in accelerator.host_syncs() if s[1].startswith("shardtune.trainer")]
    assert out == [[0] * 5] * 4 and len(forwards) == 5
    # the early stop's 4 counts read at once (fewer than decode.STOP_EVERY forwards), then the completions
    assert reads == ["shardtune.trainer.decode:_first_all_ended", "shardtune.trainer.sampling:_sample_batch"]
