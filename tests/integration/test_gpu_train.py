"""The product on a CUDA GPU, through the real CLI: NCCL, bf16, checkpointing, offload, LoRA and export.

One worker per visible GPU (a lent machine has one; NCCL runs a group of one). Skipped without CUDA; on a lent GPU
run `.venv/bin/python -m pytest -q -m gpu tests`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from tests.integration.test_lora_train import base_model

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
pytestmark = pytest.mark.gpu


def _train(tmp_path: Path, name: str, recipe: str, *overrides: str) -> list[dict]:
    run = tmp_path / name
    nproc = max(1, torch.cuda.device_count())
    cmd = [SHARDTUNE, "train", recipe, f"train.output_dir={run}", "launch.device=cuda",
           f"launch.nproc_per_node={nproc}", "train.max_steps=20", "data.num_samples=800", "train.eval_every=0",
           "train.demo_eval=false", "train.profile_memory=true", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_bf16_tracks_fp32_on_gpu(tmp_path):
    """bf16 all-gathers and compute with fp32 masters: the loss curve stays near fp32's and learns as much."""
    fp32 = _train(tmp_path, "fp32", "tiny-cpu", "engine.mixed_precision=fp32")
    bf16 = _train(tmp_path, "bf16", "tiny-cpu", "engine.mixed_precision=bf16")
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(a["loss"] - b["loss"]) < 0.05 * a["loss"], (a["step"], a["loss"], b["loss"])
    assert bf16[-1]["loss"] < 0.8 * bf16[0]["loss"]
    # Device memory is what the tracker reports on CUDA: bf16 gathers halve the gathered bytes.
    assert bf16[-1]["peak_mem_bytes"] < fp32[-1]["peak_mem_bytes"]


def test_all_features_on_gpu_export_peft_adapter(tmp_path):
    """LoRA + bf16 + checkpointing + offload (pinned host states, H2D before each gather), then the exported
    adapter loads with PEFT and reproduces the logits of the trained model's final/."""
    plain = _train(tmp_path, "plain", "tiny-lora-cpu", "engine.cpu_offload=false",
                   "engine.activation_checkpointing=false", "train.save_every=0")
    full = _train(tmp_path, "full", "tiny-lora-cpu", "train.save_every=10")
    assert full[-1]["loss"] < full[0]["loss"]
    # Offload keeps states on the host and checkpointing drops activations: the device peak falls.
    assert full[-1]["peak_mem_bytes"] < plain[-1]["peak_mem_bytes"]
    out = tmp_path / "export"
    proc = subprocess.run([SHARDTUNE, "export", str(tmp_path / "full" / "checkpoints"), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = base_model()(input_ids=ids).logits
        exported = PeftModel.from_pretrained(base_model(), str(out)).eval()(input_ids=ids).logits
        final = PeftModel.from_pretrained(base_model(), str(tmp_path / "full" / "final")).eval()(input_ids=ids).logits
    torch.testing.assert_close(exported, final, rtol=0, atol=0)  # step 20 both: the same adapters
    assert not torch.allclose(exported, base)
