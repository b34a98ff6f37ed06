"""data.format=preference: pair layout in the cache, prompt masking, truncation, chat rows, field remapping, pairs
kept whole across ranks and micro-batches, and bad rows through `main()` (the installed executable's one line:
tests/integration/test_installed_executable.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.formats import IGNORE, encode_row
from shardtune.data.pair_encoding import encode_pair, encode_preference, truncate_pair
from shardtune.data.preference import PairBatches
from shardtune.templates import render_prompt
from tests.unit.cli_helpers import run_cli

TOK = build_char_tokenizer()


def test_truncation_keeps_prompt_end_and_response_start():
    p, c, r = list(range(100, 120)), list(range(200, 230)), list(range(300, 310))
    tp, tc, tr, cut = truncate_pair(p, c, r, 32)
    assert cut and len(tp) == 16 and tp == p[-16:]  # the prompt keeps seq_len // 2 tokens: its end
    assert tc == c[:16] and tr == r  # one budget for both responses: their start
    assert truncate_pair(p[:4], c, r, 32)[0] == p[:4]  # a short prompt is kept whole
    assert truncate_pair(p[:4], c[:5], r, 32)[3] is False


def _pairs(data, split="train"):
    rows = getattr(data, split)
    ids, labels, _ = rows.take(np.arange(len(rows)))
    return ids, labels


def test_builtin_pairs_share_the_prompt_and_mask_it(tmp_path):
    cfg = DataConfig(path="builtin:prefer-reverse", format="preference", seq_len=32, num_samples=60)
    data = build_data(cfg, TOK, seed=0, output_dir=str(tmp_path))
    ids, labels = _pairs(data)
    assert len(ids) == 2 * data.manifest["stats"]["train"]["pairs"] > 0
    for k in range(0, len(ids), 2):
        chosen, rejected = (TOK.decode(x[x != TOK.pad_token_id]) for x in ids[k : k + 2])
        prompt = chosen.split("=")[0]
        assert rejected.startswith(prompt + "=\n")  # data.template=plain: the prompt, then a newline
        s = prompt.split()[-1]
        assert chosen == f"{prompt}=\n{s[::-1]}</s>" and rejected != chosen
        for x, y in zip(ids[k : k + 2], labels[k : k + 2]):  # targets: exactly the response (and EOS)
            assert TOK.decode(x[y != IGNORE]).rstrip("</s>") in (s[::-1], rejected.split("=\n")[1].rstrip("</s>"))
            n = 1 + len(TOK(prompt.removeprefix("<s>") + "=\n", add_special_tokens=False)["input_ids"])  # + BOS
            assert (y[:n] == IGNORE).all() and y[n] != IGNORE


@pytest.mark.parametrize("template", ["plain", "alpaca", "Q: {prompt} A:"])
def test_string_pairs_render_the_prompt_as_sft_does(template):
    """Issue 59's pair: a DPO row's prompt tokens equal the SFT rendering of the same prompt with the same
    data.template (they were joined with no separator, and data.template was ignored), so a DPO run started from
    an SFT run's final/ sees its prompts in the shape they were trained on."""
    pair = {"prompt": "sky?", "chosen": "blue", "rejected": "green"}
    sft_cfg = DataConfig(format="instruction", template=template)
    sft_ids, sft_labels = encode_row({"prompt": "sky?", "response": "blue"}, sft_cfg, TOK)
    cfg = DataConfig(format="preference", template=template)
    p, c, r = encode_pair(pair, cfg, TOK)
    assert p + c == sft_ids and [IGNORE] * len(p) + c == sft_labels
    assert TOK.decode(p) == "<s>" + render_prompt(template, "sky?")
    assert TOK.decode(r) == "green</s>"
    if template == "plain":
        assert TOK.decode(p + c) == "<s>sky?\nblue</s>"
    (chosen, chosen_labels), _ = encode_preference({k: [v] for k, v in pair.items()}, cfg, TOK)  # validate's sample
    assert (chosen, chosen_labels) == (sft_ids, sft_labels)


def test_a_template_on_conversational_pairs_is_warned_as_ignored(tmp_path):
    """Their chat template renders them; data.template renders string prompts only (it was ignored silently)."""
    turns = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
             "rejected": [{"role": "assistant", "content": "no"}]}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(turns) + "\n")
    cfg = DataConfig(path=str(path), format="preference", template="alpaca", eval_fraction=0.0)
    with pytest.warns(UserWarning, match="data.template=alpaca is ignored: these preference rows are conversations"):
        build_data(cfg, TOK, seed=0, output_dir=str(tmp_path))


def test_chat_rows_and_remapped_fields(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    rows = [{"q": msgs, "good": [{"role": "assistant", "content": "yo"}], "bad": "no"}] * 3
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(path=str(path), format="preference", seq_len=64, prompt_field="q", chosen_field="good",
                     rejected_field="bad", eval_fraction=0.0)
    p, c, r = encode_pair(rows[0], cfg, TOK)
    full = list(TOK.apply_chat_template(msgs + [{"role": "assistant", "content": "yo"}], tokenize=True,
                                        return_dict=True)["input_ids"])
    assert p + c == full and TOK.decode(r).startswith("no")
    ids, labels = _pairs(build_data(cfg, TOK, seed=0, output_dir=str(tmp_path)))
    assert TOK.decode(ids[0][labels[0] != IGNORE]) == TOK.decode(c)


def test_chat_pairs_read_their_turns_as_the_chat_format_does():
    """ShareGPT turns and content lists in preference rows render as their OpenAI, plain-text twins (they went to
    the chat template as written: ShareGPT's {from, value} rendered empty, a content list as its repr)."""
    plain = {"prompt": [{"role": "user", "content": "hi there"}],
             "chosen": [{"role": "assistant", "content": "good one"}], "rejected": [{"role": "assistant", "content": "no"}]}
    sharegpt = {k: [{"from": {"user": "human", "assistant": "gpt"}[t["role"]], "value": t["content"]} for t in v]
                for k, v in plain.items()}
    parts = {k: [{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]} for t in v]
             for k, v in plain.items()}
    cfg = DataConfig(format="preference")
    assert encode_pair(sharegpt, cfg, TOK) == encode_pair(parts, cfg, TOK) == encode_pair(plain, cfg, TOK)


def test_pairs_stay_whole_across_ranks_and_micro_batches(tmp_path):
    cfg = DataConfig(path="builtin:prefer-reverse", format="preference", seq_len=32, num_samples=80)
    data = build_data(cfg, TOK, seed=0, output_dir=str(tmp_path))
    one = PairBatches(data.train, micro_batch_size=4, grad_accum=2, world_size=1, seed=3)
    two = PairBatches(data.train, micro_batch_size=2, grad_accum=2, world_size=2, seed=3)
    for step in range(3):
        ref, norm = one.step(step, 0)
        assert norm == 8
        got = [two.step(step, r)[0] for r in range(2)]
        # the same 8 pairs per step; each micro-batch = b chosen rows then their b rejected rows
        assert sorted(np.concatenate([m.pair_ids for m in ref]).tolist()) == \
            sorted(np.concatenate([m.pair_ids for ms in got for m in ms]).tolist())
        for mb in ref + [m for ms in got for m in ms]:
            b = len(mb.pair_ids)
            assert mb.input_ids.shape[0] == 2 * b
            for i in range(b):
                pc = TOK.decode(mb.input_ids[i]).split("=")[0]
                assert TOK.decode(mb.input_ids[b + i]).split("=")[0] == pc


def _write(tmp_path: Path, rows: list[dict]) -> list[str]:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return ["prepare", "tiny-dpo-cpu", f"data.path={path}", f"train.output_dir={tmp_path / 'run'}",
            "data.eval_fraction=0"]


def test_rows_without_rejected_are_one_line_exit_2(tmp_path, capsys):
    good = {"prompt": "x", "chosen": "y", "rejected": "z"}
    # a file with no rejected column at all
    code, _, err = run_cli(_write(tmp_path, [{"prompt": "a", "chosen": "b"}] * 2), capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "rejected" in lines[0], err
    # in-process (same main()): one row with rejected null, named as validate names it (prepare reads the head first)
    for missing in ("rejected", "chosen"):
        code, _, err = run_cli(_write(tmp_path, [good, {**good, missing: None}]), capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and f"line 2, column '{missing}'" in lines[0], err
        assert "missing or null" in lines[0], err


def test_identical_pairs_are_dropped_counted_and_warned(tmp_path, capsys):
    rows = [{"prompt": "x", "chosen": "y", "rejected": "z"}, {"prompt": "x", "chosen": "same", "rejected": "same"},
            {"prompt": "x", "chosen": "a" * 40 + "1", "rejected": "a" * 40 + "2"}]  # differ past data.seq_len only
    code, out, err = run_cli([*_write(tmp_path, rows), "data.seq_len=32"], capsys)
    assert code == 0, err
    assert "warning: data: 2 preference rows have chosen identical to rejected" in err  # the CLI's one-line voice
    assert "once truncated to data.seq_len=32" in err
    assert "preference pairs: 1 train, 0 eval; 2 dropped" in out
