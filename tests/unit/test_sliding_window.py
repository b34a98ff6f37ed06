"""Per-document attention (model/attention.py) with a sliding window: a packed row gives each document what
transformers' eager attention (its own sliding-window mask) gives it alone, for documents longer and shorter than
the window, with grouped key/value heads, and the gradients agree. Before the window was read, every document
longer than the window attended to all its earlier tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.model import attention
from shardtune.model.attention import NAME, register

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def _compare(ours, eager, docs: list[int]) -> None:
    ids = [torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(n)) for n in docs]
    packed = torch.cat(ids, dim=1)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    got = ours(input_ids=packed, position_ids=pos).logits
    want = torch.cat([eager(input_ids=x, position_ids=torch.arange(x.shape[1])[None]).logits for x in ids], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    got.square().mean().backward()
    want.square().mean().backward()
    grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    for name, p in ours.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("block", [1024, 5], ids=["block=window", "block<window"])
def test_mistral_window_in_a_packed_row(monkeypatch, block):
    """Mistral with an 8-token window, grouped heads: documents of 30 and 20 tokens run in blocks of the window
    (or of 5 queries), the 6-token one is plain causal."""
    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    config = json.loads((CONFIGS / "tiny-llama.json").read_text())
    mistral = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    def config():  # one each: from_config writes the attention's name into the config it is given
        return AutoConfig.for_model("mistral", **{**mistral, "sliding_window": 8, "num_hidden_layers": 2})

    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(config(), attn_implementation=register(), dtype=torch.float32)
    eager = AutoModelForCausalLM.from_config(config(), attn_implementation="eager", dtype=torch.float32)
    eager.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == NAME and eager.config._attn_implementation == "eager"
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads
    _compare(ours, eager, [30, 6, 20])
    ids = torch.randint(3, 120, (2, 30), generator=torch.Generator().manual_seed(1))  # rows of one document each
    torch.testing.assert_close(ours(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
