"""Your own data, first try (validate and prepare through the CLI's `main` forked from the suite's preloaded server,
tests/integration/runs.py `forked_cli`; the mix trains on a forked rank, forked.py; the text file through the
installed executable): Alpaca with and without `input`, ShareGPT, OpenAI
messages with a system turn, txt and parquet, in one weighted mix: validate, prepare, train 10 steps; the cache
holds each format's template text with the prompt masked. And txt under the demo recipe (its demo check on), for
train.epochs instead of max_steps."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardtune.config import load_recipe
from shardtune.data import build_data
from shardtune.data.formats import IGNORE
from shardtune.model.build import build_tokenizer
from shardtune.templates import render_prompt
from tests.integration import forked
from tests.integration.runs import cli, forked_cli, metrics

N = 120
SYSTEM = "answer in one word"


def _write(tmp_path: Path) -> Path:
    def jsonl(name: str, rows: list[dict]) -> None:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("alpaca_input.jsonl", [{"instruction": f"Colour of fruit {i}", "input": f"fruit {i}", "output": f"red{i}"}
                                 for i in range(N)])
    jsonl("alpaca.jsonl", [{"instruction": f"Name fruit {i}", "output": f"apple{i}"} for i in range(N)])
    jsonl("sharegpt.jsonl", [{"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": f"yo{i}"}]}
                             for i in range(N)])
    jsonl("openai.jsonl", [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q {i}"},
                                         {"role": "assistant", "content": f"a{i}"}]} for i in range(N)])
    (tmp_path / "notes.txt").write_text("".join(f"note number {i}\n" for i in range(N)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"double {i}" for i in range(N)], "response": [str(2 * i) for i in range(N)]}),
                   tmp_path / "pairs.parquet")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"""
model: {{config: configs/models/tiny-llama.json, tokenizer: builtin:char}}
data:
  format: instruction
  seq_len: 256
  eval_fraction: 0.05
  path:
    - {{path: alpaca_input.jsonl, template: alpaca, weight: 2}}
    - {{path: alpaca.jsonl, template: alpaca}}
    - {{path: sharegpt.jsonl, format: chat}}
    - {{path: openai.jsonl, format: chat}}
    - {{path: notes.txt, format: text}}
    - {{path: pairs.parquet}}
train: {{output_dir: {tmp_path / 'run'}, max_steps: 10, micro_batch_size: 7, demo_eval: true, log_every: 5}}
launch: {{nproc_per_node: 1, device: cpu}}
""")
    return recipe


def _documents(part) -> list[tuple[str, str]]:
    """(text, trained text) of every document in a cached split, split at the position-id resets."""
    tok = build_tokenizer(load_recipe("tiny-cpu").model)
    ids, labels, pos = part.train.take(np.arange(len(part.train)))
    docs = []
    for row_ids, row_labels, row_pos in zip(ids, labels, pos):
        starts = [i for i in range(len(row_pos)) if row_pos[i] == 0] + [len(row_pos)]
        for a, b in zip(starts, starts[1:]):
            if row_ids[a] == tok.pad_token_id:
                continue
            docs.append((tok.decode(row_ids[a:b].tolist()),
                         tok.decode([t for t, lab in zip(row_ids[a:b], row_labels[a:b]) if lab != IGNORE])))
    return docs


def test_every_format_validates_prepares_and_trains_in_a_mix(tmp_path):
    recipe = _write(tmp_path)
    proc = forked_cli("validate", str(recipe), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("ok:"), proc.stderr
    proc = forked_cli("prepare", str(recipe), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for text in ("dataset 6 of 6", "format: instruction (prompt=instruction, response=output; template alpaca)",
                 "prompt=instruction, response=output, input=input", "format: chat (messages=conversations",
                 "format: text (text=text)", "format: instruction (prompt=prompt, response=response; template plain)"):
        assert text in proc.stdout, proc.stdout

    data = build_data(load_recipe(recipe).data, build_tokenizer(load_recipe(recipe).model), seed=0,
                      output_dir=str(tmp_path / "run"))
    assert not data.built  # prepare's cache
    expect = {  # per dataset: the document text and the trained part, from the row's number
        0: lambda i: ("<s>" + render_prompt("alpaca", f"Colour of fruit {i}", f"fruit {i}") + f"red{i}</s>", f"red{i}</s>"),
        1: lambda i: ("<s>" + render_prompt("alpaca", f"Name fruit {i}") + f"apple{i}</s>", f"apple{i}</s>"),
        2: lambda i: (f"<s>user:hi {i}</s><s>assistant:yo{i}</s>", f"yo{i}</s>"),
        3: lambda i: (f"<s>system:{SYSTEM}</s><s>user:q {i}</s><s>assistant:a{i}</s>", f"a{i}</s>"),
        4: lambda i: (f"<s>note number {i}</s>", f"note number {i}</s>"),
        5: lambda i: (f"<s>double {i}\n{2 * i}</s>", f"{2 * i}</s>"),
    }
    for k, part in enumerate(data.parts):
        docs = _documents(part)
        assert len(docs) == part.manifest["stats"]["train"]["documents"] > 100
        for text, trained in docs:
            number = int("".join(c for c in trained.split("</s>")[0] if c.isdigit()) or -1)
            if k == 5:
                number //= 2
            assert (text, trained) == expect[k](number), (k, text, trained)

    run = forked.train(recipe, world=1)  # the launcher's checks and the worker (the executable: the test below)
    assert run.code == 0, run.err[-2000:]
    assert "train.demo_eval: skipped (a mix of datasets)" in run.out
    lines = metrics(tmp_path / "run")
    assert [r["step"] for r in lines] == list(range(1, 11)) and lines[-1]["epoch"] == pytest.approx(
        10 * 7 / len(data.train), abs=1e-3)


def test_text_file_with_the_demo_recipe_trains_and_skips_the_demo(tmp_path):
    (tmp_path / "notes.txt").write_text("".join(f"note number {i}\n" for i in range(200)))
    proc = cli("train", "tiny-cpu", "data.path=notes.txt", "data.format=text", "train.max_steps=null",
               "train.epochs=1.5", "train.warmup_steps=0", f"train.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train.demo_eval: skipped (data.format=text has no prompt/response pairs)" in proc.stdout
    # train.epochs: the steps for 1.5 passes over the packed training rows, the epoch on the progress lines
    records = metrics(tmp_path / "run")
    steps = records[-1]["step"]
    assert f"train.epochs=1.5: {steps} steps of 16 rows" in proc.stdout + proc.stderr
    epoch = records[-1]["epoch"]
    assert epoch >= 1.5 > epoch * (steps - 1) / steps  # the fewest steps that cover 1.5 passes
    assert f"step {steps}/{steps}  epoch {records[-1]['epoch']:.2f}" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["accuracy_after"] is None
