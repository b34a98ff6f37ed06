"""How generate/chat ask a model (model/prompt_style.py): chat for chat runs and for DPO on conversations (explicit or
implicit prompt), the instruction template or plain text otherwise; a folder's record read back; --system where the
model has no place for it is left out with a warning."""
from __future__ import annotations

import json
import warnings

import pytest

from shardtune.config.load import load_recipe
from shardtune.errors import UserError
from shardtune.launcher.generate import Loaded, render
from shardtune.model.build import build_tokenizer
from shardtune.model.prompt_style import STYLE_FILE, PromptStyle, folder_style, style_of_recipe, write_style

TURNS = [{"role": "user", "content": "sky?"}, {"role": "assistant", "content": "blue"}]
WRONG = [{"role": "user", "content": "sky?"}, {"role": "assistant", "content": "green"}]


@pytest.mark.parametrize("row,kind", [
    ({"prompt": TURNS[:1], "chosen": TURNS[1:], "rejected": WRONG[1:]}, "chat"),
    ({"chosen": TURNS, "rejected": WRONG}, "chat"),  # TRL's implicit prompt
    ({"prompt": "sky?", "chosen": "blue", "rejected": "green"}, "instruction"),  # data.template, as SFT renders it
])
@pytest.mark.parametrize("store", ["jsonl", "saved"])  # saved: a `datasets` folder, as a Hub id's split is kept
def test_dpo_runs_are_asked_as_their_pairs_were_rendered(tmp_path, row, kind, store):
    path = tmp_path / f"pairs.{store}"
    if store == "saved":
        import datasets

        datasets.Dataset.from_list([row]).save_to_disk(str(path))
    else:
        path.write_text(json.dumps(row) + "\n")
    assert style_of_recipe(load_recipe("tiny-dpo-cpu", [f"data.path={path}"])).kind == kind


@pytest.mark.parametrize(("prompt", "style"), [(TURNS[:1], PromptStyle("chat")),
                                              ("sky?", PromptStyle("instruction", "alpaca"))])
def test_grpo_runs_are_asked_as_their_prompts_were_rendered(tmp_path, prompt, style):
    from types import SimpleNamespace

    from shardtune.config.schema import DataConfig

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "answer": "blue"}) + "\n")
    recipe = SimpleNamespace(data=DataConfig(path=str(path), format="prompt", template="alpaca"))
    assert style_of_recipe(recipe) == style


def test_sft_formats_and_a_folders_record(tmp_path):
    assert style_of_recipe(load_recipe("tiny-cpu", ["data.format=chat"])) == PromptStyle("chat")
    assert style_of_recipe(load_recipe("tiny-cpu")) == PromptStyle("instruction", "plain")
    write_style(tmp_path, PromptStyle("instruction", "alpaca"))
    assert folder_style(tmp_path, has_chat_template=True) == PromptStyle("instruction", "alpaca")
    (tmp_path / STYLE_FILE).write_text("{")
    with pytest.raises(UserError, match=STYLE_FILE):
        folder_style(tmp_path, has_chat_template=True)


def test_system_is_left_out_with_a_warning_for_a_model_trained_on_prompts():
    recipe = load_recipe("tiny-cpu")
    loaded = Loaded(None, build_tokenizer(recipe.model), recipe)  # render needs no model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert render(loaded, "reverse ab=", system="be brief") == render(loaded, "reverse ab=")
    assert any("--system is ignored" in str(w.message) for w in caught)
    chat = load_recipe("tiny-cpu", ["data.format=chat"])
    text = render(Loaded(None, build_tokenizer(chat.model), chat), "hi", system="be brief")
    assert text.index("system") < text.index("be brief") < text.index("hi")
