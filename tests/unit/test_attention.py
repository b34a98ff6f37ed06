"""Per-document attention (model/attention.py): packed rows behave as their documents alone, with no s x s tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.config.schema import ModelConfig
from shardtune.data.formats import IGNORE
from shardtune.data.packing import doc_lengths
from shardtune.engine.loss import token_loss_sum
from shardtune.model.attention import NAME
from shardtune.model.attention_mask import generation_attention
from shardtune.model.build import build_model
from tests.unit.bytes_written import BytesCreated

DOCS = (5, 11, 3, 9)  # one packed row of 28 tokens


def _model():
    model = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)  # the default: sdpa
    assert model.config._attn_implementation == NAME
    return model


def _doc(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 0] = IGNORE  # as packing masks a document's first label
    return ids, labels


def _loss_and_grads(model, ids, labels, pos, **kw):
    model.zero_grad()
    loss = token_loss_sum(model, ids, labels, pos, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_doc_lengths_from_position_ids():
    pos = np.array([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert doc_lengths(pos) == ((3, 2, 1, 2), (8,))


@pytest.mark.parametrize("passed", [True, False], ids=["host-doc-lengths", "from-position-ids"])
def test_packed_row_equals_its_documents_alone(passed):
    """The packed row's loss and gradient are the sum of each document's alone (fp32, 1e-5): no attention across a
    document boundary, so gradients never mix. Both ways of finding the documents give it."""
    model = _model()
    docs = [_doc(n, seed) for seed, n in enumerate(DOCS)]
    ids = torch.cat([d[0] for d in docs], dim=1)
    labels = torch.cat([d[1] for d in docs], dim=1)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    kw = {"doc_lengths": doc_lengths(pos.numpy())} if passed else {}
    packed_loss, packed_grads = _loss_and_grads(model, ids, labels, pos, **kw)
    alone = [_loss_and_grads(model, d[0], d[1], torch.arange(d[0].shape[1])[None]) for d in docs]
    torch.testing.assert_close(packed_loss, sum(a[0] for a in alone), rtol=1e-5, atol=1e-5)
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, sum(a[1][name] for a in alone), rtol=1e-5, atol=1e-5)
    # and it differs from attending across documents (the test can fail)
    cross_loss, _ = _loss_and_grads(model, ids, labels, pos, doc_lengths=((sum(DOCS),),))
    assert abs(float(cross_loss - packed_loss)) > 1e-3


def test_matches_transformers_sdpa_with_its_packing_mask():
    """Same loss as transformers' own sdpa path, which builds the (b,1,s,s) mask from the position ids."""
    ours = _model()
    ref = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0)
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (2, 28), generator=torch.Generator().manual_seed(7))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None].repeat(2, 1)
    pos[1] = torch.cat([torch.arange(20), torch.arange(8)])
    with torch.no_grad():
        a = ours(input_ids=ids, position_ids=pos, use_cache=False, doc_lengths=doc_lengths(pos.numpy())).logits
        b = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("ours", [True, False], ids=["per-document", "transformers-mask"])
def test_packed_row_creates_no_s_squared_tensor(ours):
    """Forward and backward of a packed row of s = 1024 tokens: no op creates a tensor of s^2/2 elements or more
    (the largest per-token tensor here is the MLP's s x 344). transformers' path builds a (1,1,s,s) mask."""
    model = _model()
    if not ours:
        model.set_attn_implementation("sdpa")
    s = 1024
    ids = torch.randint(3, 128, (1, s), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(700), torch.arange(s - 700)])[None]
    with _LargestOutput() as seen:
        token_loss_sum(model, ids, ids, pos, doc_lengths=doc_lengths(pos.numpy())).backward()
    assert (seen.numel < s * s // 2) == ours, seen.numel


def test_backward_writes_no_whole_input_per_document():
    """The attention's backward over a row of D documents: what it writes grows with the tokens, not with D x the
    tokens. Cutting each document out by indexing made every document's backward write a zero-filled gradient of
    the whole query, key and value (32 documents: 171 MB); split assembles each in one concatenation (3.7 MB
    against 2.6 MB for one document, views not counted)."""
    from shardtune.model.attention import document_attention

    s, heads, d = 512, 4, 32

    def written(docs: int) -> int:
        q, k, v = (torch.randn(2, h, s, d, requires_grad=True) for h in (heads, 2, 2))
        out, _ = document_attention(None, q, k, v, None, doc_lengths=[[s // docs] * docs] * 2)
        with BytesCreated() as seen:
            out.backward(torch.ones_like(out))
        return seen.bytes

    one, many = written(1), written(32)
    assert many < 2 * one, (one, many)


def test_batched_generation_with_left_padding_matches_transformers_sdpa():
    """transformers' generate on the per-document attention, which transformers gives no mask (the left padding
    is told by the position ids), and under generation_attention (transformers' SDPA): its SDPA's greedy tokens."""
    ours = _model().eval()
    ref = build_model(ModelConfig(config="configs/models/tiny-llama.json"), seed=0).eval()
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4], ids[0, :4] = 0, 0
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    want = ref.generate(**kw)
    with generation_attention(ours):
        assert torch.equal(ours.generate(**kw), want)
    assert ours.config._attn_implementation == NAME
    assert torch.equal(ours.generate(**kw), want)
