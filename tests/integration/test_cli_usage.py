"""The installed `shardtune` executable, as a user meets it: every usage error of every command is typer's usage
hint plus one error naming the offending argument, exit 2, never a traceback; recipe-level errors are one line;
`--help` of every command and `--version` exit 0; Ctrl-C is one line, exit 130.

Usage errors, --help and --version run through the real entry point (not in-process) on purpose: a CLI-library
release that changes how errors reach `cli.main()` (typer 0.29 stopped raising the separate `click` package's
exceptions) turns these red. They start at once in a thread pool (each is a ~0.5 s process start). The recipe errors
run the same `main()` forked from the suite's preloaded server (runs.py forked_cli): most build the model on meta.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.runs import forked_cli

EXE = Path(sys.executable).with_name("shardtune")
# Wide, plain output: typer's rich error box must not wrap the argument name across lines.
ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}

# (argv, what the error must name). Every command has rows; usage errors only: typer's own parsing.
USAGE_ERRORS: list[tuple[list[str], str]] = [
    (["bogus"], "bogus"),                                                         # unknown command
    (["--bogus"], "--bogus"),                                                     # unknown top-level option
    (["--version=yes"], "--version"),                                             # a flag given a value
    (["train"], "recipe"),                                                        # missing argument
    (["train", "--bogus", "tiny-cpu"], "--bogus"),                                # unknown option
    (["validate"], "recipe"),
    (["validate", "tiny-cpu", "--strict"], "--strict"),
    (["plan"], "recipe"),
    (["plan", "tiny-cpu", "--jsn"], "--jsn"),                                    # a typo of --json
    (["plan", "tiny-cpu", "--top", "many"], "--top"),                             # wrong type
    (["plan", "tiny-cpu", "--top", "0"], "--top"),                                # out of range
    (["plan", "tiny-cpu", "--png"], "--png"),                                     # option without its value
    (["slurm", "tiny-cpu"], "--nodes"),                                           # missing required option
    (["slurm", "tiny-cpu", "--nodes", "zero"], "--nodes"),
    (["slurm", "tiny-cpu", "--nodes", "0"], "--nodes"),
    (["slurm", "tiny-cpu", "--nodes", "2", "--gpus-per-node", "-1"], "--gpus-per-node"),
    (["export"], "checkpoint"),
    (["export", "runs/x/checkpoints"], "out_dir"),
    (["export", "a", "b", "--max-shard-size-mb", "big"], "--max-shard-size-mb"),
    (["export", "a", "b", "c"], "(c)"),                                           # extra argument
    (["recipes", "extra"], "extra"),
    (["recipes", "--all"], "--all"),
]
PREPARE_USAGE_ERRORS: list[tuple[list[str], str]] = [
    (["prepare"], "recipe"),
    (["prepare", "tiny-cpu", "--force"], "--force"),
]

# Errors in the recipe, not the command line: one line on stderr naming the key or file, exit 2.
RECIPE_ERRORS: list[tuple[list[str], str]] = [
    (["validate", "tiny-cpu", "train.lrr=1e-4"], "train.lrr"),
    (["slurm", "no-such-recipe", "--nodes", "1"], "no-such-recipe"),
    (["train", "tiny-cpu", "engine.strategy=everything"], "engine.strategy"),
    (["prepare", "tiny-cpu", "data.path=no-such-file.jsonl"], "no-such-file.jsonl"),
    (["validate", "tiny-cpu", "engine.offload_activations=true"], "engine.offload_activations"),  # needs checkpointing
    # mixtures of experts: a LoRA target that matches nothing, a router target, the balance loss without experts
    (["validate", "tiny-moe-cpu", "lora.enabled=true", "lora.target_modules=[gate_proj]"], "lora.target_modules"),
    (["train", "tiny-moe-cpu", "lora.enabled=true", "lora.target_modules=[q_proj,gate]"], "router"),
    (["validate", "tiny-cpu", "train.router_aux_loss_coef=0.01"], "train.router_aux_loss_coef"),
    (["validate", "tiny-moe-cpu", "lora.enabled=true", "train.objective=dpo", "data.format=preference",
      "data.path=builtin:prefer-reverse", "train.demo_eval=false"], "train.objective=dpo"),
]

COMMANDS = ["train", "validate", "plan", "slurm", "export", "recipes", "prepare"]
HELP = [[], ["--help"], *([c, "--help"] for c in COMMANDS)]

def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), *argv], capture_output=True, text=True, timeout=180, env=ENV)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    if not EXE.is_file():
        pytest.fail(f"{EXE} is missing: install the project (`make install`) so the entry point exists")
    argvs = [argv for argv, _ in USAGE_ERRORS + PREPARE_USAGE_ERRORS] + HELP + [["--version"]]
    with ThreadPoolExecutor(max_workers=6) as pool:
        out = dict(zip(map(tuple, argvs), pool.map(_run, argvs)))
    # Recipe errors are what validate computes, several by building the model on meta (~8 CPU-s of imports in a
    # fresh interpreter): the same main(), forked from the suite's preloaded server. The executable's own
    # one-line refusal of a recipe value is tests/integration/test_installed_executable.py's.
    cwd = tmp_path_factory.mktemp("recipe_errors")
    return out | {tuple(argv): forked_cli(*argv, cwd=cwd) for argv, _ in RECIPE_ERRORS}


def _error_part(output: str) -> str:
    """The error without typer's usage hint ("Usage: ...", "Try 'shardtune train --help' for help."). The hint
    is there whenever the parser knows the command; an option's own syntax error (`--png` with no value) has none."""
    if output.startswith("Usage: shardtune"):
        return output.split("for help.", 1)[1]
    return output


def _ids(rows: list[tuple[list[str], str]]) -> list[str]:
    return [" ".join(argv) for argv, _ in rows]


@pytest.mark.parametrize("argv,needle", USAGE_ERRORS + PREPARE_USAGE_ERRORS,
                         ids=_ids(USAGE_ERRORS + PREPARE_USAGE_ERRORS))
def test_usage_error_is_usage_hint_and_one_error(results, argv, needle):
    r = results[tuple(argv)]
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    error = _error_part(r.stderr)
    assert needle.lower() in error.lower(), error  # typer < 0.16 writes argument names in capitals
    # One error line, bare ("Error: ...") or in rich's box (borders drawn on their own lines).
    assert len([line for line in error.splitlines() if line.strip(" │") and line[:1] not in "╭╰"]) == 1, error


@pytest.mark.parametrize("argv,needle", RECIPE_ERRORS, ids=_ids(RECIPE_ERRORS))
def test_recipe_error_is_one_line(results, argv, needle):
    r = results[tuple(argv)]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a) or "no-args")
def test_help_exits_0(results, argv):
    r = results[tuple(argv)]
    # No arguments shows the help too (exit code 0 or click's 2 for "no command" are both seen across releases).
    assert r.returncode in ((0, 2) if not argv else (0,)), r.stderr
    assert "Usage: shardtune" in r.stdout and "Traceback" not in r.stdout + r.stderr
    for command in COMMANDS if len(argv) <= 1 else []:
        assert command in r.stdout


def test_version_names_the_stack(results):
    r = results[("--version",)]
    assert r.returncode == 0, r.stderr
    from shardtune import __version__

    for needle in (f"shardtune {__version__}", "python 3.", "torch 2.", "NCCL", "gloo", "transformers "):
        assert needle in r.stdout, r.stdout


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the child importing torch")
def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    # Interrupted in the middle of real work: `prepare` tokenizing 200k rows (~15 s), signalled once its cache build
    # has visibly started (its temp folder exists). Interrupting `plan` raced it: plan now ends ~1 s after its
    # imports, and a SIGINT that lands during interpreter exit is ignored (exit 0).
    data = tmp_path / "big.jsonl"
    row = '{"instruction": "reverse the letters of abcdefghij", "output": "jihgfedcba"}\n'
    data.write_text(row * 200_000)
    cache = tmp_path / "cache"
    proc = subprocess.Popen([str(EXE), "prepare", "tiny-cpu", f"data.path={data}", f"data.cache_dir={cache}",
                             f"train.output_dir={tmp_path / 'run'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            # a terminal's foreground job: SIGINT at its default even when this suite runs in the
                            # background (`make test &` ignores SIGINT, and a child inherits that)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while proc.poll() is None and not any(cache.glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, ("prepare finished before it could be interrupted", proc.communicate())
    time.sleep(0.5)  # inside the tokenizing map, not at its first line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and err.strip().splitlines() == ["shardtune: interrupted (Ctrl-C)"], err
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]  # no finished cache entry was left
