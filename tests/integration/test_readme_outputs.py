"""The docs' command-output blocks (README.md and docs/*.md, found by their text: tests/docs_blocks.py) are what the
commands print today: `plan`, the script `slurm` writes and the shape of `--version`. Each is regenerated here and
compared, up to the date and the paths of the machine."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.docs_blocks import block_after

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))


def run(*args: str, cwd: Path | None = None, columns: int = 120) -> str:
    proc = subprocess.run([SHARDTUNE, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={"COLUMNS": str(columns), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_plan_block():
    got = run("plan", "llama-3.1-70b-lora-4x24gb")
    assert got.rstrip() == block_after("$ shardtune plan llama-3.1-70b-lora-4x24gb --png "
                                       "docs/plan-llama-3.1-70b-lora-4x24gb.png")


def test_slurm_script_block(tmp_path):
    (tmp_path / "sft.jsonl").write_text('{"text": "a"}\n')
    run("slurm", "llama-3.1-405b-lora-4x8x80gb", "data.path=sft.jsonl", "--nodes", "4", "--gpus-per-node", "8",
        "--partition", "gpu", "--time", "24:00:00", "-o", "llama405b.sbatch", cwd=tmp_path)
    got = (tmp_path / "llama405b.sbatch").read_text().replace(str(tmp_path.resolve()), "/home/me/ft")
    got = got.replace(SHARDTUNE, "/home/me/shardtune/.venv/bin/shardtune")
    want = "#!/bin/bash\n" + block_after("```bash\n#!/bin/bash")
    date = re.compile(r" on \d{4}-\d\d-\d\d \d\d:\d\d\.")
    assert date.sub(" on DATE.", got.rstrip()) == date.sub(" on DATE.", want)


def test_version_block_shape():
    def shape(text: str) -> list[str]:  # version numbers, build tags and platform words vary; the lines do not
        return [re.sub(r"\d[\w.+-]*", "V", ln).split(" (")[0] for ln in text.strip().splitlines()]

    got = shape(run("--version"))
    want = shape(block_after("$ shardtune --version"))
    assert got[:2] == want[:2] and got[-1] == want[-1] and len(got) == len(want), (got, want)


def test_grpo_keys_block():
    """docs/grpo.md's keys are `shardtune keys grpo` as it prints them today (schema comments, defaults)."""
    assert run("keys", "grpo").rstrip() == block_after("$ shardtune keys grpo")
