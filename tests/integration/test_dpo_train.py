"""`shardtune train tiny-dpo-cpu`'s training: a short SFT warm-up, then DPO; held-out reward accuracy goes
from 50 % where DPO starts (policy = reference) to >= 90 %, and the DPO metrics reach metrics.jsonl and TensorBoard.
The run is on one forked rank with the recipe's global batch (forked.py: the launcher's checks and the worker without
the CLI's start-up; the CLI's own behaviour is tested on the SFT recipes, DPO's 2-rank parity in
tests/distributed/test_dpo.py), the export through the CLI."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.integration import forked
from tests.integration.runs import forked_cli, metrics

DPO_KEYS = {"dpo_loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"}


def test_tiny_dpo_cpu_learns_preferences(tmp_path):
    run = tmp_path / "run"
    proc = forked.train_on_one_rank("tiny-dpo-cpu", f"train.output_dir={run}", "train.save_final=false",
                                    "train.save_every=1000")
    assert proc.code == 0, proc.err[-3000:]
    records = metrics(run)
    warmup = [r for r in records if r.get("phase") == "sft_warmup"]
    assert len(warmup) == 60 and warmup[-1]["loss"] < warmup[0]["loss"]  # the short SFT learned something
    start = records[60]
    assert DPO_KEYS <= start.keys() and abs(start["start_eval_reward_accuracy"] - 0.5) < 1e-9
    final = records[-1]
    assert final["eval_reward_accuracy"] >= 0.9, [r.get("eval_reward_accuracy") for r in records]
    assert final["eval_reward_margin"] > 0 and final["eval_loss"] < start["start_eval_loss"]
    assert "eval_reward_acc" in proc.out and (run / "dpo_reference.npz").exists()
    assert f"held-out reward accuracy: 50.0% where DPO started (policy = reference) -> " \
           f"{final['eval_reward_accuracy']:.1%} after" in proc.out
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # export: the last checkpoint (saved at the final step) consolidates into an HF model that loads
    out = forked_cli("export", str(run / "checkpoints"), str(tmp_path / "hf"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.isfinite(p).all() for p in model.parameters())
