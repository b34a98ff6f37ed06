"""Data and recipe checks through the installed executable, not just `main()`: what the process prints (one line,
exit 2, no traceback; prepare's report, and no warning from transformers) is what a user sees.

The in-process halves of these checks are in tests/unit (test_config_errors, test_preference_data,
test_trl_formats, test_long_docs, test_data_cache). Every command here starts at once, two at a time: each is a
single-threaded start-up (imports) of a few seconds, so two share 2 cores without slowing each other.
"""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.runs import SHARDTUNE
from tests.unit.test_data_cache import _rows, _write
from tests.unit.test_long_docs import write_docs


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _commands(tmp: Path) -> dict[str, tuple[list[str], Path]]:
    """name -> (argv after `shardtune`, cwd)."""
    dirs = {n: tmp / n for n in ("config", "rejected", "unshared", "long", "prepare")}
    for d in dirs.values():
        d.mkdir()
    no_rejected = _jsonl(dirs["rejected"] / "pairs.jsonl", [{"prompt": "a", "chosen": "b"}] * 2)
    unrelated = {"chosen": [_msg("user", "a"), _msg("assistant", "b")], "rejected": [_msg("user", "c")]}
    unshared = _jsonl(dirs["unshared"] / "rows.jsonl", [unrelated] * 2)
    write_docs(dirs["long"] / "long.txt", [5000, 20, 9000])  # over the char tokenizer's model_max_length (4096)
    good = _write(dirs["prepare"] / "d.jsonl", _rows(80))
    bad = dirs["prepare"] / "bad.jsonl"
    bad.write_text('{"body": "no prompt column"}\n')
    return {
        "config": (["train", "tiny-cpu", "train.micro_batch_size=0"], dirs["config"]),
        "rejected": (["prepare", "tiny-dpo-cpu", f"data.path={no_rejected}", "data.eval_fraction=0",
                      f"train.output_dir={dirs['rejected'] / 'run'}"], dirs["rejected"]),
        "unshared": (["prepare", "tiny-dpo-cpu", f"data.path={unshared}", "model.chat_template=chatml",
                      "data.eval_fraction=0", f"train.output_dir={dirs['unshared'] / 'run'}"], dirs["unshared"]),
        "long": (["prepare", "tiny-cpu", f"data.path={dirs['long'] / 'long.txt'}", "data.format=text",
                  "data.seq_len=64", "data.long_docs=split", "data.eval_fraction=0",
                  f"train.output_dir={dirs['long'] / 'run'}"], dirs["long"]),
        "prepare_good": (["prepare", "tiny-cpu", f"data.path={good}", "data.seq_len=32",
                          f"train.output_dir={dirs['prepare'] / 'run'}"], dirs["prepare"]),
        "prepare_bad": (["prepare", "tiny-cpu", f"data.path={bad}", "data.seq_len=32",
                         f"train.output_dir={dirs['prepare'] / 'run'}"], dirs["prepare"]),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    commands = _commands(tmp_path_factory.mktemp("executable"))

    def run(item):
        name, (argv, cwd) = item
        return name, (subprocess.run([SHARDTUNE, *argv], capture_output=True, text=True, timeout=300, cwd=cwd), cwd)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, commands.items()))


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_a_bad_recipe_value_prints_no_traceback(results):
    """(from tests/unit/test_config_errors.py::test_real_process_prints_no_traceback)"""
    proc, _ = results["config"]
    assert "micro_batch_size" in _one_line(proc)


def test_a_file_without_rejected_is_one_line(results):
    """(the executable's half of tests/unit/test_preference_data.py::test_rows_without_rejected_are_one_line_exit_2)"""
    proc, _ = results["rejected"]
    assert "rejected" in _one_line(proc)


def test_pairs_with_nothing_shared_are_one_line(results):
    """(the executable's half of tests/unit/test_trl_formats.py::
    test_prepare_takes_both_layouts_and_refuses_pairs_with_nothing_shared)"""
    proc, _ = results["unshared"]
    assert "share no opening turn" in _one_line(proc)


def test_prepare_reports_the_split_and_no_tokenizer_length_warning(results):
    """(moved from tests/unit/test_long_docs.py)"""
    proc, _ = results["long"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    pieces = 1 + sum(-(-(n + 2 - 1) // 63) for n in (5000, 9000))
    assert f"split documents (longer than data.seq_len=64): 2 (train 2, eval 0), into {pieces:,} pieces" in proc.stdout
    assert "Token indices sequence length" not in proc.stderr, proc.stderr


def test_prepare_cli_prints_stats_and_bad_data_exits_2(results):
    """(moved from tests/unit/test_data_cache.py)"""
    (proc, cwd), (bad, _) = results["prepare_good"], results["prepare_bad"]
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-2000:]
    run = cwd / "run"
    entry = next(p for p in (run / "data_cache").iterdir() if not p.name.startswith("."))
    assert f"cache: {entry} (built in" in out and (entry / "manifest.json").exists()
    stats = json.loads((entry / "manifest.json").read_text())["stats"]["train"]
    for text in (f"source rows: 80 -> train {stats['documents']} documents in {stats['rows']} rows of 32",
                 f"tokens: {stats['tokens']:,} train ({stats['target_tokens']:,} with a loss)",
                 "truncated documents", "packing efficiency:", "document length"):
        assert text in out, out
    counts = out.split("truncated documents (longer than data.seq_len=32): ")[1].split("\n")[0]
    assert (f"{counts} documents longer" in err) == (counts.split()[0] != "0"), (out, err)  # the same counts

    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert len(errors) == 1 and "column" in errors[0] and "data.path" in errors[0]
