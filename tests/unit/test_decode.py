"""Greedy decoding (trainer/decode.py): transformers' greedy tokens on a real device; on the simulated GPU, whose host reads
are zeros, at most max_new_tokens forwards (transformers' `generate` would loop for good there)."""
from __future__ import annotations

import tempfile

import pytest
import torch

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.config.schema import ModelConfig
from shardtune.model.build import build_model
from shardtune.plan.simulate import _simulated_world
from shardtune.trainer.decode import greedy_decode


def _tiny():
    return build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0).eval()


def test_left_padded_batch_with_eos_matches_transformers_generate():
    ours, ref = _tiny(), _tiny()
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4], ids[0, :4] = 0, 0
    mask[2, :2], ids[2, :2] = 0, 0
    free = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free[1, 9 + 2])  # row 1's third new token ends it there; the other rows go on
    kw = {"max_new_tokens": 10, "pad_token_id": 0, "eos_token_id": eos}
    want = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)
    got = greedy_decode(ours, ids, mask, **kw)
    assert torch.equal(got, want), (got, want)
    assert (got[1, 12:] == 0).all() and got.shape[1] > 12  # row 1 padded after its EOS, the others decoded on


def test_all_rows_ending_stops_early():
    model = _tiny()
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    first = greedy_decode(model, ids, max_new_tokens=1, pad_token_id=0)[0, -1]
    out = greedy_decode(model, ids, max_new_tokens=20, pad_token_id=0, eos_token_id=int(first))
    assert out.shape == (1, 7)


@pytest.mark.parametrize("every", [2, 3, 5, 16])
def test_early_stop_read_every_k_tokens_gives_the_per_token_output(every):
    """decode.STOP_EVERY on a GPU: the ended counts read once every k forwards, the forwards past the end cut off.
    Two rows ending at different tokens, the last end inside a window, at a window's edge, in the last partial
    window (token 18 of 20: the last forward is never read), and no end at all."""
    from shardtune.trainer.decode import decode_tokens

    model = _tiny()
    # greedy: row 0 draws 47 x 17, then 36, 24, 24; row 1 draws 11 x 9, then 102 first at token 9, 121 at 10
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(7))
    lengths = []
    for stops in [(47, 11), (47, 121), (36, 102), (24, 102), (3,)]:
        kw = {"max_new_tokens": 20, "pad_token_id": 0, "stop_ids": stops, "world_size": 1,
              "pick": lambda logits, _: logits.argmax(-1)}
        want = decode_tokens(model, ids, None, stop_every=1, **kw)
        got = decode_tokens(model, ids, None, stop_every=every, **kw)
        assert torch.equal(got, want), (every, stops, got.shape, want.shape)
        lengths.append(want.shape[1])
    assert lengths == [1, 11, 18, 19, 20], lengths  # the premise: where the per-token check stops


def test_demo_eval_on_the_simulated_gpu_is_bounded_by_max_new_tokens():
    """exact_match through the trainer's model on the simulated GPU: every early-stop read says "not ended" (0),
    so decoding runs to its budget and stops there; one forward per token, one read for the 6 forwards' early-stop
    counts (fewer than decode.STOP_EVERY: read once, after the loop) and the output's."""
    from shardtune.trainer.evaluate import exact_match
    from shardtune.trainer.train import setup

    samples = [{"prompt": "abc", "response": "cba"}, {"prompt": "hello", "response": "olleh"}]
    with tempfile.TemporaryDirectory() as tmp, _simulated_world(1, 1):
        run = setup(load_recipe("tiny-cpu", ["launch.device=cuda", f"train.output_dir={tmp}"]), simulated=True)
        forwards = []
        run.model.register_forward_hook(lambda *_: forwards.append(1))
        accelerator.TRACE.clear()
        assert exact_match(run.model, run.tok, samples, run.rt, max_new_tokens=7) == 0.0  # zeros decode to ""
        reads = [s for s in accelerator.host_syncs() if s[1].startswith(("shardtune.trainer.decode", "shardtune.trainer.evaluate"))]
        assert len(forwards) == 7
        early_stop, output = ("to_host", "shardtune.trainer.decode:_first_all_ended"), ("to_host", "shardtune.trainer.evaluate:exact_match")
        assert reads == [early_stop, output]
        assert run.model.config._attn_implementation == "shardtune_sdpa"  # the training attention is back
