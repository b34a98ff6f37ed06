"""Resume checks (checkpoint/resume_check.py): `shardtune train` refuses a checkpoint of another model (exit 2, naming the keys)
or of other data (exit 2 unless train.resume=force), and keeps the global batch at another world size. The
checkpoint here is its trainer.json alone, as the worker writes it: the launcher decides before any worker starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.checkpoint.resume_check import fingerprint
from shardtune.config.load import load_recipe_config, to_recipe
from tests.unit.cli_helpers import run_cli

BASE = ["data.num_samples=300", "data.seq_len=64", "train.max_steps=6"]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run of tiny-cpu (2 workers x micro-batch 8) with a complete checkpoint at step 6."""
    run = tmp_path / "run"
    recipe = to_recipe(load_recipe_config("tiny-cpu", [*BASE, f"train.output_dir={run}"]))
    ckpt = run / "checkpoints" / "step_6"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 6, "world_size": 2,
                                                    "fingerprint": fingerprint(recipe, 2)}))
    return run


def train(run_dir: Path, capsys, *overrides: str) -> tuple[int, str]:
    code, _, err = run_cli(["train", "tiny-cpu", *BASE, f"train.output_dir={run_dir}", "launch.device=cpu",
                            "--no-check", *overrides], capsys)
    return code, err


@pytest.mark.parametrize("override,keys", [
    ("model.config=configs/models/tiny-qwen2.json", ["model.architecture"]),
    ("model.tokenizer=configs/models", ["model.tokenizer"]),
    ("lora.enabled=true", ["lora.enabled", "lora.r", "lora.target_modules"]),
], ids=["model", "tokenizer", "lora"])
def test_another_model_is_exit_2_naming_the_keys_even_with_force(run_dir, capsys, override, keys):
    for resume in ("auto", "force"):
        code, err = train(run_dir, capsys, override, f"train.resume={resume}")
        assert code == 2 and "another model" in err and "Traceback" not in err, err
        assert all(k in err for k in keys) and len(err.strip().splitlines()) == 1, err


def test_a_lora_rank_change_is_another_model(tmp_path, capsys):
    run = tmp_path / "run"
    lora = ["lora.enabled=true", "lora.r=8", f"train.output_dir={run}"]
    recipe = to_recipe(load_recipe_config("tiny-cpu", [*BASE, *lora]))
    ckpt = run / "checkpoints" / "step_6"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 6, "fingerprint": fingerprint(recipe, 2)}))
    code, err = train(run, capsys, *lora[:1], "lora.r=16")
    assert code == 2 and "lora.r 8 -> 16" in err, err


@pytest.mark.parametrize("override,key", [
    ("data.seq_len=32", "data.seq_len 64 -> 32"),
    ("data.packing=false", "data.packing True -> False"),  # another format: the data check refuses it first
    ("data.long_docs=split", "data.long_docs 'truncate' -> 'split'"),
    ("train.seed=1", "train.seed 0 -> 1"),
    ("train.micro_batch_size=4", "global_batch 16 -> 8"),
    ("model.chat_template=chatml", "model.chat_template None -> 'chatml'"),
], ids=["seq_len", "packing", "long-docs", "seed", "global-batch", "chat-template"])
def test_other_data_is_exit_2_unless_forced(run_dir, capsys, override, key):
    code, err = train(run_dir, capsys, override)
    assert code == 2 and key in err and "train.resume=force" in err, err


@pytest.mark.parametrize("nproc,fix", [
    (3, "use a number of workers that divides 16"),
    (4, "use train.micro_batch_size=1 train.grad_accum=4 or train.micro_batch_size=2 train.grad_accum=2 or "
        "train.micro_batch_size=4 train.grad_accum=1"),
])
def test_a_world_that_cannot_keep_the_global_batch_is_exit_2_with_values_that_work(run_dir, capsys, nproc, fix):
    # 4 workers x micro-batch 8 = 32 > 16; 3 workers cannot divide 16 at all
    code, err = train(run_dir, capsys, f"launch.nproc_per_node={nproc}")
    assert code == 2 and "global batch of 16" in err and fix in err, err


def test_another_world_scales_grad_accum(run_dir):
    from shardtune.checkpoint.resume_check import check_resume

    cfg = load_recipe_config("tiny-cpu", [*BASE, f"train.output_dir={run_dir}", "launch.nproc_per_node=1"])
    out = check_resume(cfg, to_recipe(cfg), 1)
    assert out.train.grad_accum == 2 and out.train.micro_batch_size == 8
    assert cfg.train.grad_accum == 1  # the caller's config is left alone


def test_context_parallel_keeps_the_global_batch_of_its_checkpoint(run_dir, tmp_path):
    """engine.context_parallel: the 2 workers share their rows (a global batch of micro x accum x 1), so switching
    it on for a run of 2 data-parallel workers doubles train.grad_accum, and a checkpoint of a context-parallel
    run resumes on one worker with its accumulation."""
    from shardtune.checkpoint.resume_check import check_resume

    cfg = load_recipe_config("tiny-cpu", [*BASE, f"train.output_dir={run_dir}", "engine.context_parallel=true"])
    assert fingerprint(to_recipe(cfg), 2)["global_batch"] == 8
    assert check_resume(cfg, to_recipe(cfg), 2).train.grad_accum == 2
    split = tmp_path / "split"
    cfg = load_recipe_config("tiny-cpu", [*BASE, f"train.output_dir={split}", "engine.context_parallel=true"])
    ckpt = split / "checkpoints" / "step_6"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 6, "fingerprint": fingerprint(to_recipe(cfg), 2)}))
    one = load_recipe_config("tiny-cpu", [*BASE, f"train.output_dir={split}", "engine.context_parallel=true",
                                          "launch.nproc_per_node=1"])
    assert check_resume(one, to_recipe(one), 1).train.grad_accum == 1


def test_dpo_settings_are_part_of_the_objective():
    from shardtune.checkpoint.resume_check import DATA, _changes

    def fp(*overrides: str) -> dict:
        return fingerprint(to_recipe(load_recipe_config("tiny-dpo-cpu", list(overrides))), 2)

    assert _changes(DATA, fp(), fp("dpo.beta=0.5", "dpo.loss=ipo")) == ["dpo.beta 4.0 -> 0.5",
                                                                        "dpo.loss 'sigmoid' -> 'ipo'"]
    assert _changes(DATA, fp(), fp("train.lr=1e-3")) == []  # lr is not the objective: allowed with a notice


def test_only_the_first_node_keeps_the_recipe_history(run_dir, monkeypatch, capsys):
    """Every node's launcher checks the resume; one of them (SLURM's node 0) writes recipes/step_N.yaml into the
    shared run directory and prints the notice."""
    from omegaconf import OmegaConf

    from shardtune.checkpoint.resume_check import check_resume

    base = [*BASE, f"train.output_dir={run_dir}"]
    OmegaConf.save(load_recipe_config("tiny-cpu", base), run_dir / "recipe.yaml")
    cfg = load_recipe_config("tiny-cpu", [*base, "train.lr=1e-3"])
    for node, kept in (("1", False), ("0", True)):
        monkeypatch.setenv("SLURM_NODEID", node)
        check_resume(cfg, to_recipe(cfg), 2)
        assert (run_dir / "recipes" / "step_6.yaml").is_file() == kept
        assert ("train.lr" in capsys.readouterr().err) == kept


def test_the_notice_compares_with_what_the_checkpoint_trained_with(tmp_path, capsys):
    """recipe.yaml is the last launch's: one that set train.lr=1e-4 and stopped before it saved left it there. The
    checkpoint (lr 3e-3) is what resumes: 1e-4 is a change, 3e-3 none. Resumed into a new train.output_dir (no
    recipe.yaml there), the change is still said."""
    from omegaconf import OmegaConf

    from shardtune.checkpoint.resume_check import check_resume, trained_recipe

    run = tmp_path / "run"
    base = [*BASE, f"train.output_dir={run}"]
    trained = to_recipe(load_recipe_config("tiny-cpu", base))
    ckpt = run / "checkpoints" / "step_6"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 6, "world_size": 2, "fingerprint": fingerprint(trained, 2),
                                                    "recipe": trained_recipe(trained)}))
    OmegaConf.save(load_recipe_config("tiny-cpu", [*base, "train.lr=1e-4"]), run / "recipe.yaml")  # stale
    for lr, said in (("1e-4", "resume from step_6 with changes (train.lr 0.003 -> 0.0001); the previous recipe is "
                               f"kept as {run / 'recipes' / 'step_6.yaml'}"), ("3e-3", None)):
        cfg = load_recipe_config("tiny-cpu", [*base, f"train.lr={lr}"])
        check_resume(cfg, to_recipe(cfg), 2)
        err = capsys.readouterr().err
        assert (err.strip() == said) if said else "train.lr" not in err, err
    elsewhere = [*BASE, f"train.output_dir={tmp_path / 'new'}", f"train.resume={ckpt}", "train.lr=1e-4"]
    cfg = load_recipe_config("tiny-cpu", elsewhere)
    check_resume(cfg, to_recipe(cfg), 2)
    assert capsys.readouterr().err.strip() == f"resume from {ckpt} with changes (train.lr 0.003 -> 0.0001)"
