"""A corpus of the mistakes people make with their own data and recipes, fed to `validate`, `prepare` and `train`
(and `plan`, for the recipe's own values): they must agree on what they accept, and each refusal is one line on
stderr, exit 2, never a traceback. prepare and train run through the installed executable; validate and plan, which
build the model on meta, through the CLI's main forked from the suite's preloaded server (runs.py forked_cli).

Cost: `prepare` and `train` run on every refused input alone (each refuses before torch loads, in ~0.3 s; train in
its launcher, before a worker starts). `validate` runs once over all the refused files as one mix (it reports every
entry's problem, one line each) and alone on each bad recipe value. The accepted inputs run as one mix through
validate, prepare (forked) and a 1-step train on one worker through the executable (a mix is refused when any of its
entries is, so accepting it accepts each).
"""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from shardtune.bundled import DATA_DIR
from tests.integration.runs import cli, forked_cli

ROWS = [{"prompt": f"caf\u00e9 {i}", "response": f"r{i}"} for i in range(40)]
JSONL = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS)
CSV = "prompt,response\n" + "".join(f'"say ""hi"", {i}","r{i}"\n' for i in range(40))  # quotes and commas
BOM = b"\xef\xbb\xbf"

# name -> file bytes, refused by all three commands.
REFUSED_FILES = {
    "latin1.jsonl": JSONL.encode("latin-1"),
    "utf16.jsonl": JSONL.encode("utf-16"),
    "empty.jsonl": b"",
    "blank.jsonl": b"\n  \n\n",
    "truncated.jsonl": (JSONL[:200].rsplit("}", 1)[0] + "\n").encode(),  # a line cut mid-object
    "not_objects.jsonl": b'["a", "b"]\n["c", "d"]\n',
    "no_response.jsonl": "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in ROWS).encode(),
    "dict_response.jsonl": "".join(json.dumps({"prompt": "p", "response": {"text": "r"}}) + "\n"
                                   for _ in ROWS).encode(),
    "bom_latin1.csv": BOM + "prompt,response\ns\u00e4y,r\n".encode("latin-1"),  # a BOM, then not UTF-8
}
# Recipe values of the wrong type or out of range, and a model config transformers cannot build (the data is good):
# `plan` judges these too.
REFUSED_OVERRIDES = {
    "max_steps_word": ["train.max_steps=ten"],
    "format_unknown": ["data.format=json"],
    "seq_len_over_positions": ["data.seq_len=100000"],
    "unknown_activation": ["model.config=bad_act.json"],
}
# Accepted files, as entries of one mix: {path, format}.
ACCEPTED = {
    "bom.jsonl": (BOM + JSONL.encode(), "instruction"),
    "crlf.jsonl": (JSONL.replace("\n", "\r\n").encode(), "instruction"),
    "bom_quoted.csv": (BOM + CSV.encode(), "instruction"),
    "bom.txt": (BOM + "".join(f"note {i}\n" for i in range(40)).encode(), "text"),
    # one line longer than the 4 MiB head validate samples: still one row. Its characters written as JSON escapes
    # (\u00e9, 6 bytes each): 5.3 MiB of line with a sixth of the characters to tokenize (~8 s less per command)
    "huge_line.jsonl": ((json.dumps({"text": "\u00e9" * (900 << 10)}) + "\n" + json.dumps({"text": "y z"}) + "\n")
                        .encode(), "text"),
}


def _recipe(tmp: Path) -> Path:
    recipe = tmp / "mine.yaml"
    recipe.write_text(f"""
model: {{config: configs/models/tiny-llama.json, tokenizer: builtin:char}}
data: {{format: instruction, seq_len: 64, eval_fraction: 0.05}}
train: {{output_dir: {tmp / 'run'}, max_steps: 1, demo_eval: false, eval_every: 0, warmup_steps: 0}}
launch: {{nproc_per_node: 1, device: cpu}}
""")
    return recipe


def _one_line_refusal(proc: subprocess.CompletedProcess, what: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("pre-flight")]
    assert proc.returncode == 2, f"{what}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, f"{what}:\n{proc.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: {lines}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("malformed")
    for name, data in {**REFUSED_FILES, **{n: d for n, (d, _) in ACCEPTED.items()}}.items():
        (tmp / name).write_bytes(data)
    config = json.loads((DATA_DIR / "configs" / "models" / "tiny-llama.json").read_text())
    (tmp / "bad_act.json").write_text(json.dumps({**config, "hidden_act": "nonsense"}))
    return tmp, _recipe(tmp)


def _mix(tmp: Path, entries: dict[str, str]) -> str:
    return "data.path=[" + ",".join(f"{{path: {tmp / n}, format: {fmt}}}" for n, fmt in entries.items()) + "]"


def test_every_malformed_input_is_refused_alike_in_one_line(corpus):
    tmp, recipe = corpus
    cases = {name: [f"data.path={tmp / name}"] for name in REFUSED_FILES}
    cases |= {name: [f"data.path={tmp / 'bom.jsonl'}", *o] for name, o in REFUSED_OVERRIDES.items()}
    jobs = [(name, cmd, [cmd, str(recipe), *overrides, f"train.output_dir={tmp / ('run_' + name)}"])
            for name, overrides in cases.items() for cmd in ("prepare", "train")]
    jobs += [(name, cmd, [cmd, str(recipe), *o]) for name, o in cases.items() if name not in REFUSED_FILES
             for cmd in ("validate", "plan")]
    jobs += [("every refused file", "validate", ["validate", str(recipe), _mix(tmp, dict.fromkeys(REFUSED_FILES,
                                                                                                "instruction"))])]
    # prepare and train refuse before torch loads: through the executable, two at a time. validate and plan build
    # the model on meta: the CLI's main forked from the preloaded server (runs.py forked_cli), one at a time.
    fresh = [i for i, job in enumerate(jobs) if job[1] in ("prepare", "train")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(fresh, pool.map(lambda i: cli(*jobs[i][2], cwd=tmp), fresh)))
    results |= {i: forked_cli(*job[2], cwd=tmp) for i, job in enumerate(jobs) if i not in results}
    results = [results[i] for i in range(len(jobs))]
    for (name, cmd, _), proc in zip(jobs[:-1], results):
        _one_line_refusal(proc, f"{cmd} {name}")
    for name in cases:  # train refused before its workers started: they would have made logs/
        assert not (tmp / f"run_{name}" / "logs").exists(), name
    proc = results[-1]  # validate: one line per refused file, each naming its file
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    named = [[n for n in REFUSED_FILES if f"/{n}'" in ln] for ln in lines]
    assert all(ln.startswith("error: ") for ln in lines) and all(len(n) == 1 for n in named), lines
    assert sorted(n for ns in named for n in ns) == sorted(REFUSED_FILES), lines


# The README's override examples, as a shell passes them (a backslash and an n): YAML cannot read them unquoted.
TEMPLATE = "Q: {prompt}\\nA: "
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}"


def test_the_accepted_inputs_are_accepted_by_all_three(corpus):
    tmp, recipe = corpus
    mix = _mix(tmp, {n: fmt for n, (_, fmt) in ACCEPTED.items()})
    # validate and prepare compute (the CLI's main, forked from the preloaded server); train through the executable
    for cmd, run in (("validate", forked_cli), ("prepare", forked_cli), ("train", cli)):
        proc = run(cmd, str(recipe), mix, f"data.template={TEMPLATE}", f"model.chat_template={CHAT_TEMPLATE}",
                   cwd=tmp)
        assert proc.returncode == 0, f"{cmd}:\n{proc.stderr[-3000:]}"
    first_rows = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(first_rows) == 1 and json.loads(first_rows[0])["step"] == 1
    trained = yaml.safe_load((tmp / "run" / "recipe.yaml").read_text())
    assert trained["data"]["template"] == "Q: {prompt}\nA: "  # a two-line template, as the README means
    assert trained["model"]["chat_template"] == "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
