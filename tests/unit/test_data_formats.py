"""The shapes people's data comes in: Alpaca (with and without input), ShareGPT, OpenAI messages, txt, parquet;
templates, separators and EOS; train_on_inputs; the errors that name the keys to set."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config.schema import DataConfig, ModelConfig
from shardtune.data import build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.fields import resolve_fields
from shardtune.data.formats import IGNORE, encode_row, to_messages
from shardtune.errors import UserError
from shardtune.model.build import build_tokenizer
from shardtune.templates import render_prompt
from shardtune.trainer.evaluate import demo_samples

TOK = build_char_tokenizer()
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"}]
SHAREGPT = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
            for m in CHAT]


def _split(ids: list[int], labels: list[int]) -> tuple[str, str]:
    """(the whole document, the trained tokens) as text."""
    return TOK.decode(ids), TOK.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("template", ["alpaca", "plain", "chatml", "Q: {prompt} ({input})\nA:"])
@pytest.mark.parametrize("inp", ["", "red or green"])
def test_instruction_is_template_separator_response_eos(template, inp):
    row = {"prompt": "Name a fruit", "input": inp, "response": "apple"}
    ids, labels = encode_row(row, DataConfig(format="instruction", template=template), TOK)
    text, trained = _split(ids, labels)
    prompt = render_prompt(template, "Name a fruit", inp)
    assert text == "<s>" + prompt + "apple</s>" and trained == "apple</s>"  # the prompt is masked, EOS trained
    assert prompt[-1] in "\n:" and (inp in prompt)  # a separator before the response; the input is not dropped
    ids2, labels2 = encode_row(row, DataConfig(format="instruction", template=template, train_on_inputs=True), TOK)
    assert ids2 == ids and labels2 == ids  # train_on_inputs: every token is a target


def test_alpaca_file_trains_without_any_mapping_and_the_cache_decodes_to_the_template(tmp_path):
    rows = [{"instruction": f"Name fruit {i}", "input": "red" if i % 2 else "", "output": f"apple{i}"} for i in range(40)]
    cfg = DataConfig(path=str(_write_jsonl(tmp_path / "alpaca.jsonl", rows)), format="instruction", template="alpaca",
                     seq_len=512, packing=False, eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, TOK, seed=0)
    ids, labels, _ = data.train.take(range(len(data.train)))
    seen = set()
    for row_ids, row_labels in zip(ids, labels):
        keep = row_ids != TOK.pad_token_id
        text, trained = _split(row_ids[keep].tolist(), row_labels[keep].tolist())
        i = int(trained.removesuffix("</s>").removeprefix("apple"))
        assert text == "<s>" + render_prompt("alpaca", f"Name fruit {i}", rows[i]["input"]) + f"apple{i}</s>"
        seen.add(i)
    assert seen == set(range(40)) and data.manifest["data"]["prompt_field"] == "instruction"


def test_sharegpt_and_openai_give_the_same_tokens_and_train_only_assistant_turns():
    a = encode_row({"messages": CHAT}, DataConfig(format="chat"), TOK)
    b = encode_row({"conversations": SHAREGPT}, resolve_fields(DataConfig(format="chat"), ["conversations"]), TOK)
    c = encode_row({"conversations": SHAREGPT}, DataConfig(format="chat", messages_field="conversations",
                                                          chat_style="sharegpt"), TOK)
    assert a == b == c
    text, trained = _split(*a)
    assert "<s>system:be brief</s>" in text and trained == "yo</s>ok</s>"
    ids, labels = encode_row({"messages": CHAT}, DataConfig(format="chat", train_on_inputs=True), TOK)
    assert labels == ids == a[0]


def _parts(turns: list[dict]) -> list[dict]:
    """The same turns with each content as a list of text parts (OpenAI's and TRL's content lists)."""
    return [{**t, "content": [{"type": "text", "text": t["content"][:2]}, {"type": "text", "text": t["content"][2:]}]}
            for t in turns]


def test_content_lists_of_text_parts_train_as_their_text():
    """Their text joined, not the list's Python repr ("[{'type': 'text', ...}]" was what the model saw)."""
    assert encode_row({"messages": _parts(CHAT)}, DataConfig(format="chat"), TOK) == \
        encode_row({"messages": CHAT}, DataConfig(format="chat"), TOK)
    image = [{"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(UserError, match="content list has a 'image' part: only text parts"):
        to_messages(image)


# OpenAI's tool calling, as TRL's datasets write it: the assistant calls, the tool answers, the assistant replies
TOOL_CHAT = [{"role": "user", "content": "6 x 7?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "mul", "arguments": '{"a": 6, "b": 7}'}}]},
             {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "mul"},
             {"role": "assistant", "content": "42"}]
TOOL_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
                 "call {{ c['function']['name'] }}{{ c['function']['arguments'] }}{% endfor %}{% else %}"
                 "{{ m['content'] }}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_tool_calls_train_as_the_template_writes_them():
    """The calling turn trains on the call the template renders (it trained as an empty reply: the calls were
    dropped); the tool's answer is context; a template that ignores tool_calls is refused."""
    tok = build_char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    ids, labels = encode_row({"messages": TOOL_CHAT}, DataConfig(format="chat"), tok)
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])
    assert trained == 'call mul{"a": 6, "b": 7}</s>42</s>', trained
    assert "tool:42</s>" in tok.decode(ids)
    assert to_messages(TOOL_CHAT)[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "mul"}
    with pytest.raises(UserError, match="the chat template does not render them"):
        encode_row({"messages": TOOL_CHAT}, DataConfig(format="chat"), TOK)  # builtin:char's template


MUL = {"type": "function", "function": {"name": "mul", "description": None,
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


def test_a_tools_column_reaches_the_template():
    """TRL's `tools` column (the functions' schemas, a list or a JSON string; Arrow's nulls dropped) is rendered
    into the prompt, untrained; a template that does not list tools is refused (the calls would train without the
    definitions)."""
    tok = build_char_tokenizer()
    tok.chat_template = "{% if tools %}tools:{{ tools | tojson }}</s>{% endif %}" + TOOL_TEMPLATE
    cfg = DataConfig(format="chat")
    as_list = encode_row({"messages": TOOL_CHAT, "tools": [MUL]}, cfg, tok)
    as_json = encode_row({"messages": TOOL_CHAT, "tools": json.dumps([MUL])}, cfg, tok)
    assert as_list == as_json
    text = tok.decode(as_list[0])
    assert text.startswith('tools:[{"type": "function", "function": {"name": "mul", "parameters"'), text
    assert "description" not in text  # the null Arrow would fill in
    assert tok.decode([i for i, lab in zip(*as_list) if lab != IGNORE]) == 'call mul{"a": 6, "b": 7}</s>42</s>'
    assert encode_row({"messages": TOOL_CHAT, "tools": None}, cfg, tok) == encode_row({"messages": TOOL_CHAT}, cfg, tok)
    tok.chat_template = TOOL_TEMPLATE  # writes calls, lists no tools
    with pytest.raises(UserError, match="have a tools column but the chat template does not render it"):
        encode_row({"messages": TOOL_CHAT, "tools": [MUL]}, cfg, tok)


def test_chat_keys_and_roles_errors_name_what_is_expected():
    with pytest.raises(UserError, match=r"expected \{from, value\}"):
        to_messages(CHAT, "sharegpt")
    with pytest.raises(UserError, match=r"\{role, content\} \(OpenAI\) or \{from, value\} \(ShareGPT\)"):
        to_messages([{"speaker": "a", "text": "b"}])
    with pytest.raises(UserError, match="unknown role 'narrator'"):
        to_messages([{"role": "narrator", "content": "x"}])
    with pytest.raises(UserError, match="list of messages"):
        to_messages("hi")


def test_model_chat_template_is_used_when_the_tokenizer_has_none():
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(UserError, match="model.chat_template=chatml"):
        encode_row({"messages": CHAT}, DataConfig(format="chat"), bare)
    tok = build_tokenizer(ModelConfig(chat_template="chatml"))
    ids, labels = encode_row({"messages": CHAT}, DataConfig(format="chat"), tok)
    text, trained = _split(ids, labels)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n") and trained == "yo<|im_end|>\nok<|im_end|>\n"


def test_missing_columns_name_the_real_keys(tmp_path):
    with pytest.raises(UserError) as e:
        resolve_fields(DataConfig(format="instruction", prompt_field="question"), ["q", "a"])
    msg = str(e.value)
    for needle in ("data.prompt_field", "data.response_field", "data.text_field", "data.messages_field", "columns: a, q"):
        assert needle in msg, msg
    assert "\n" not in msg and "instruction_field" not in msg and "chat_field" not in msg
    with pytest.raises(UserError, match="data.input_field"):  # an input column named explicitly must exist
        resolve_fields(DataConfig(format="instruction", input_field="context"), ["prompt", "response"])
    assert resolve_fields(DataConfig(format="instruction"), ["prompt", "response"]).input_field == ""


def test_demo_check_only_on_prompt_response_pairs(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}\n" for i in range(40)))
    data = build_data(DataConfig(path=str(text), format="text", seq_len=32, eval_fraction=0.1,
                                 cache_dir=str(tmp_path / "c")), TOK, seed=0)
    assert demo_samples(data, 8, announce=True) == []
    assert capsys.readouterr().out.strip() == "train.demo_eval: skipped (data.format=text has no prompt/response pairs)"
    rows = [{"q": f"reverse ab{i}=", "a": f"{i}ba", "ctx": "x"} for i in range(40)]
    cfg = DataConfig(path=str(_write_jsonl(tmp_path / "p.jsonl", rows)), format="instruction", prompt_field="q",
                     response_field="a", input_field="ctx", template="alpaca", seq_len=256, eval_fraction=0.1,
                     cache_dir=str(tmp_path / "c"))
    samples = demo_samples(build_data(cfg, TOK, seed=0), 8, announce=True)
    assert len(samples) == 4 and capsys.readouterr().out == ""
    for s in samples:  # the prompt as trained: rendered with the template and the input
        i = int(s["response"].removesuffix("ba"))
        assert s["prompt"] == render_prompt("alpaca", f"reverse ab{i}=", "x")


@pytest.mark.parametrize("suffix", ["parquet", "txt"])
def test_parquet_and_txt_build(tmp_path, suffix):
    import datasets

    path = tmp_path / f"d.{suffix}"
    if suffix == "parquet":
        datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(30)], "response": [f"r{i}" for i in range(30)],
                                    "input": [None] * 30}).to_parquet(str(path))
        fmt = "instruction"
    else:
        path.write_text("".join(f"text {i}\n" for i in range(30)))
        fmt = "text"
    data = build_data(DataConfig(path=str(path), format=fmt, seq_len=32, packing=False, eval_fraction=0.0,
                                 cache_dir=str(tmp_path / "c")), TOK, seed=0)
    ids, labels, _ = data.train.take([0])
    text, trained = _split(ids[0][ids[0] != 0].tolist(), labels[0][ids[0] != 0].tolist())
    if fmt == "instruction":
        i = int(trained.removesuffix("</s>")[1:])
        assert text == f"<s>p{i}\nr{i}</s>"  # a null input is no input
    else:
        assert text.startswith("<s>text ") and trained == text[len("<s>"):]  # the first token predicts nothing
