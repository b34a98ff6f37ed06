"""`generate`/`chat` on a chat-trained run stop a reply where the chat template ends an assistant turn (chatml's
`<|im_end|>`, a newline for the plain template): what such a run learnt to emit there, since its turns are trained
to end with the template's marker, not with EOS."""
from __future__ import annotations

import pytest

from shardtune.config.load import load_recipe
from shardtune.launcher.generate import Loaded, Sampling, complete, render, turn_end
from shardtune.model.build import build_model, build_tokenizer
from shardtune.model.prompt_style import PromptStyle


def loaded(fmt: str, template: str) -> Loaded:
    recipe = load_recipe("tiny-cpu", [f"data.format={fmt}", f"model.chat_template={template}"])
    tok = build_tokenizer(recipe.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    return Loaded(build_model(recipe.model, seed=0).eval(), tok, recipe)


@pytest.mark.parametrize("fmt,template,end", [("chat", "chatml", "<|im_end|>"), ("chat", "plain", "\n"),
                                              ("instruction", "chatml", None)])
def test_the_turn_end_comes_from_the_template(fmt, template, end):
    assert turn_end(loaded(fmt, template)) == end


def test_a_chat_reply_is_cut_at_the_turn_end():
    """The random tiny model is forced (prefix_allowed_tokens_fn) to write 'ok<|im_end|>' and then more: generation
    stops inside the marker, and the reply is the text before it."""
    import torch

    run = loaded("chat", "chatml")
    text = render(run, "abc")
    assert text.endswith("<|im_start|>assistant\n")
    forced = run.tok("ok<|im_end|>\nmore text after the turn", add_special_tokens=False)["input_ids"]
    start = len(run.tok(text, add_special_tokens=False)["input_ids"])
    generate = run.model.generate

    def forcing(**kw):
        kw["prefix_allowed_tokens_fn"] = lambda _, ids: [forced[min(len(ids) - start, len(forced) - 1)]]
        return generate(**kw)

    run.model.generate = forcing
    assert complete(run, text, Sampling(max_new_tokens=30)) == "ok"
    out = run.model.generate(**run.tok(text, return_tensors="pt", add_special_tokens=False), max_new_tokens=30,
                             stop_strings=["<|im_end|>"], tokenizer=run.tok, pad_token_id=run.tok.pad_token_id)
    assert out.shape[1] - start == len(run.tok("ok<|im_end|>", add_special_tokens=False)["input_ids"])  # stopped
    run.style = PromptStyle("text")  # not a chat model: no turn end, all the forced text
    assert complete(run, text, Sampling(max_new_tokens=30)).startswith("ok<|im_end|>\nmore")
    assert torch.is_tensor(out)
