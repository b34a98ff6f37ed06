"""KEY=VALUE overrides (config/overrides.py) as the recipe receives them: the examples of docs/recipes.md as a shell
passes them (a backslash and an n), Jinja, quoting; YAML values for the other keys. Through the executable:
tests/integration/test_malformed_inputs.py."""
from __future__ import annotations

import pytest

from shardtune.config.load import load_recipe
from shardtune.errors import UserError

JINJA = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}"


def test_string_keys_take_the_text_with_escapes_decoded():
    r = load_recipe("tiny-cpu", ["data.template=Q: {prompt}\\nA: ", f"model.chat_template={JINJA}",
                                 "data.prompt_field=question: text", "train.output_dir=runs/a:b"])
    assert r.data.template == "Q: {prompt}\nA: "
    assert r.model.chat_template == "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert r.data.prompt_field == "question: text" and r.train.output_dir == "runs/a:b"


@pytest.mark.parametrize("value,want", [("'Q: {prompt}\\n'", "Q: {prompt}\\n"), ('"Q: {prompt}\\n"', "Q: {prompt}\n"),
                                        ("{prompt}", "{prompt}")])
def test_quoted_values_are_yaml_strings(value, want):
    assert load_recipe("tiny-cpu", [f"data.template={value}"]).data.template == want


def test_other_keys_are_yaml():
    r = load_recipe("tiny-cpu", ["train.lr=1e-4", "lora.target_modules=[q_proj,k_proj]", "train.max_steps=null",
                                 "train.epochs=1", "launch.nproc_per_node=1"])
    assert (r.train.lr, r.lora.target_modules, r.train.max_steps, r.launch.nproc_per_node) == \
        (1e-4, ["q_proj", "k_proj"], None, 1)


@pytest.mark.parametrize("override,names", [("data.template=Q: {promt}", "data.template"),
                                            ("train.lr={x: 1}", "train.lr"), ("train.max_steps=ten", "train.max_steps"),
                                            ("=3", "KEY=VALUE")])
def test_a_bad_value_names_its_key(override, names):
    with pytest.raises(UserError, match=names.replace(".", r"\.")):
        load_recipe("tiny-cpu", [override])
