"""validate, plan and slurm understand DPO recipes (prepare: test_preference_data.py; train and export:
tests/integration/test_dpo_train.py)."""
from __future__ import annotations

import json

import pytest

from tests.unit.cli_helpers import run_cli

RECIPES = ["tiny-dpo-cpu", "llama-3.1-8b-dpo-lora-1x24gb"]


@pytest.mark.parametrize("name", RECIPES)
def test_validate_and_plan(name, capsys):
    code, out, err = run_cli(["validate", name], capsys)
    assert code == 0 and out.startswith(f"ok: {name}"), err
    code, out, err = run_cli(["plan", name], capsys)
    assert code == 0, err
    assert "DPO: micro-batch 1 pair(s) = 2 rows" in out or "DPO: micro-batch 8 pair(s) = 16 rows" in out
    reference = "adapters off" if "lora" in name else "precomputed"
    assert reference in out.replace("\n", " ")


def test_plan_counts_both_rows_of_a_pair(capsys):
    """A DPO micro-batch of b pairs plans like an SFT micro-batch of 2b rows (same model, same seq_len) with the
    full logits: DPO's sequence log-probs do not take the chunked loss."""
    _, dpo, _ = run_cli(["plan", "llama-3.1-8b-dpo-lora-1x24gb", "--json"], capsys)
    _, sft, _ = run_cli(["plan", "llama-3.1-8b-dpo-lora-1x24gb", "--json", "train.objective=sft",
                         "data.format=instruction", "data.path=builtin:reverse", "train.micro_batch_size=2", "train.loss_chunk_tokens=0"], capsys)
    assert json.loads(dpo)["per_rank"] == json.loads(sft)["per_rank"]


def test_slurm_script_for_a_dpo_recipe(tmp_path, capsys):
    out = tmp_path / "dpo.sbatch"
    code, _, err = run_cli(["slurm", "llama-3.1-8b-dpo-lora-1x24gb", "--nodes", "1", "--gpus-per-node", "1",
                            "-o", str(out)], capsys)
    assert code == 0, err
    text = out.read_text()
    assert "plan: fits" in text and "llama-3.1-8b-dpo-lora-1x24gb" in text


def test_a_resumed_reference_table_of_other_pairs_is_refused(tmp_path):
    """train.resume=force on other data: the run dir's precomputed reference no longer matches the pairs; one line
    instead of an IndexError (or a silently wrong reference)."""
    import numpy as np

    from shardtune.errors import UserError
    from shardtune.trainer.objective import REFERENCE_FILE, DpoObjective

    np.savez(tmp_path / REFERENCE_FILE, train=np.zeros((10, 2)), eval=np.zeros((2, 2)))
    obj = DpoObjective.__new__(DpoObjective)  # only what the resume path reads
    obj.warmup, obj.train_pairs, obj.eval_pairs, obj.reference = 0, [None] * 10, [None] * 2, {}
    obj._load_or_compute_reference(None, None, tmp_path, step=3)
    assert obj.reference["train"].shape == (10, 2)
    obj.train_pairs = [None] * 12
    with pytest.raises(UserError, match="reference log-probs of other pairs"):
        obj._load_or_compute_reference(None, None, tmp_path, step=3)
