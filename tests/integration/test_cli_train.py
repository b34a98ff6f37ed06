"""`shardtune train` end to end: 2 CPU workers via torchrun, the run directory, and final/ that HF loads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.bundled import DATA_DIR
from shardtune.config import load_recipe
from shardtune.data import build_data
from shardtune.data.batches import num_targets
from shardtune.trainer.evaluate import token_loss_sum
from tests.integration import forked

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
FIELDS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "comm_bytes", "peak_mem_bytes"}


def overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [f"train.output_dir={tmp_path / 'run'}", "train.max_steps=6", "data.num_samples=400", "train.eval_every=3",
            "train.demo_eval_samples=8", "train.profile_memory=true", *extra]


def train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDTUNE, "train", "tiny-cpu", *overrides(tmp_path, *extra)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("backend", ["torch", "shardtune"])
def test_train_two_workers_end_to_end(tmp_path, backend):
    """The default backend through the CLI; PyTorch's FSDP2 on forked ranks (forked.py: the same launcher checks and
    worker without the CLI's start-up), as the launcher's part does not depend on the backend."""
    if backend == "shardtune":
        proc = train(tmp_path, f"engine.backend={backend}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("pre-flight (2 x CPU"), proc.stdout[:2000]
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        run = forked.train("tiny-cpu", *overrides(tmp_path, f"engine.backend={backend}"))
        code, stdout, stderr = run.code, run.out, run.err
    assert code == 0, stderr[-3000:]
    run = tmp_path / "run"
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 7))
    # Each record's lr is the rate its step's update used: tiny-cpu's warmup (20 steps to 3e-3) starts at 0.
    assert [r["lr"] for r in lines] == pytest.approx([3e-3 * k / 20 for k in range(6)])
    assert FIELDS <= lines[0].keys()
    assert "eval_loss" in lines[2] and "eval_loss" in lines[5]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert all(r["peak_mem_bytes"] > 0 for r in lines)
    resolved = OmegaConf.load(run / "recipe.yaml")
    assert resolved.train.max_steps == 6 and resolved.engine.backend == backend
    assert list((run / "tensorboard").glob("events.out.tfevents.*")) and (run / "loss.png").stat().st_size > 1000
    assert "held-out exact-match accuracy" in stdout
    # Not a terminal: plain progress lines at step 1, eval steps and the last one (log_every=20 > 6), then a summary.
    assert [ln.split()[1] for ln in stdout.splitlines() if ln.startswith("step ")] == ["1/6", "3/6", "6/6"]
    assert "done: steps 1-6 of 6" in stdout

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    ids = tok("<s>reverse abc=", return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # The exported weights are the trained ones: on the held-out rows they give the run's last eval_loss.
    recipe = load_recipe(run / "recipe.yaml")
    data = build_data(recipe.data, tok, seed=recipe.train.seed, output_dir=recipe.train.output_dir)  # a cache hit
    n = min(len(data.eval), recipe.train.eval_batches * recipe.train.micro_batch_size * 2)
    ids, labels, pos = (torch.from_numpy(x) for x in data.eval.take(range(n)))
    with torch.no_grad():
        loss = token_loss_sum(model, ids, labels, pos)
    expected = lines[-1]["eval_loss"]
    assert abs(float(loss) / num_targets(labels) - expected) < 1e-4 * expected


def test_data_error_in_worker_is_one_line(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"body": "no text column"}\n')
    proc = train(tmp_path, f"data.path={bad}", "data.format=text")
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "column" in err[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_tokenizer_past_the_models_vocabulary_stops_the_workers_in_one_line(tmp_path):
    """The workers' check (the launcher reads no tokenizer): before the data is tokenized, one line, exit 2."""
    config = json.loads((DATA_DIR / "configs" / "models" / "tiny-llama.json").read_text())
    small = tmp_path / "vocab64.json"
    small.write_text(json.dumps({**config, "vocab_size": 64}))
    run = forked.train("tiny-cpu", f"model.config={small}", f"train.output_dir={tmp_path / 'run'}")
    err = [ln for ln in run.err.splitlines() if ln.strip()]
    assert run.code == 2 and len(err) == 1 and "the model's vocab_size is 64" in err[0], run.err[-2000:]
    assert not (tmp_path / "run" / "data_cache").exists()  # refused before tokenizing


def test_train_fit_applies_and_records_the_fastest_fitting_configuration(tmp_path):
    """A recipe the search improves (checkpointing on, micro-batch 4 x 2): --fit turns checkpointing off, runs
    micro-batch 8 x 1 (same global batch) and, since a CPU run's backward is staggered (its communication adds to
    compute rather than hiding under it), keeps parameters gathered through backward (shard_grad_op: one gather per
    unit fewer); recipe.yaml, which the workers and any resume or `slurm` read, holds them."""
    run = tmp_path / "run"
    proc = subprocess.run([SHARDTUNE, "train", "tiny-cpu", "--fit", f"train.output_dir={run}", "train.max_steps=2",
                           "data.num_samples=300", "data.seq_len=64", "train.demo_eval=false", "train.eval_every=0",
                           "train.save_final=false", "engine.activation_checkpointing=true",
                           "train.micro_batch_size=4", "train.grad_accum=2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("train --fit: engine.strategy: full_shard -> shard_grad_op; engine.activation_checkpointing: true -> "
            "false; train.micro_batch_size: 4 -> 8; train.grad_accum: 2 -> 1") in proc.stdout
    text = (run / "recipe.yaml").read_text()
    assert text.startswith("# engine/train settings chosen by `shardtune train --fit`")
    recipe = load_recipe(run / "recipe.yaml")
    assert (recipe.engine.strategy, recipe.engine.activation_checkpointing, recipe.train.micro_batch_size,
            recipe.train.grad_accum) == ("shard_grad_op", False, 8, 1)
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["tokens"] == 8 * 2 * 64  # global batch unchanged
