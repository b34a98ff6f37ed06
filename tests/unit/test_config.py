"""Recipe loading: bundled names, overrides, interpolation, resolved paths, the public surface."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from shardtune.config.load import list_bundled_recipes, load_recipe, load_recipe_config, recipe_keys
from tests.unit.cli_helpers import run_cli


def test_bundled_name_and_overrides():
    r = load_recipe("tiny-cpu", ["train.lr=1e-4", "engine.strategy=no_shard", "lora.target_modules=[q_proj]"])
    assert r.train.lr == 1e-4 and r.engine.strategy == "no_shard" and r.lora.target_modules == ["q_proj"]
    assert Path(r.model.config).is_absolute() and Path(r.model.config).exists()


def test_interpolation_and_now(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  config: configs/models/tiny-llama.json\n"
                      "data:\n  path: builtin:reverse\n"
                      "train:\n  output_dir: ${oc.env:HOME}/runs/${now:%Y}-x\n  max_steps: ${train.save_every}\n"
                      "  save_every: 7\n")
    r = load_recipe(recipe)
    assert r.train.max_steps == 7
    assert r.train.output_dir.endswith("-x") and "${" not in r.train.output_dir


def test_relative_paths_resolve_against_recipe_folder(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  config: configs/models/tiny-llama.json\ndata:\n  path: data.jsonl\n")
    assert load_recipe(recipe).data.path == str((tmp_path / "data.jsonl").resolve())


def test_resolved_recipe_round_trips(tmp_path):
    cfg = load_recipe_config("tiny-cpu", ["train.max_steps=3"])
    out = tmp_path / "recipe.yaml"
    out.write_text(OmegaConf.to_yaml(cfg))
    again = load_recipe(out)
    assert again.train.max_steps == 3 and again == load_recipe("tiny-cpu", ["train.max_steps=3"])


def test_every_bundled_recipe_validates():
    recipes = list_bundled_recipes()  # rglob: sub-folders included
    top_level = Path(__file__).resolve().parents[2] / "recipes"  # the one copy, at the repository's top level
    assert set(recipes) == {p.stem for p in top_level.rglob("*.yaml")} and "tiny-cpu" in recipes
    for path in recipes.values():
        load_recipe(path)  # raises UserError on any problem


def test_recipes_command_lists_bundled(capsys):
    code, out, _ = run_cli(["recipes"], capsys)
    assert code == 0 and "tiny-cpu" in out and "Demo" in out


# The public surface changes only on purpose: update these sets together with the docs.
EXPECTED_COMMANDS = {"train", "validate", "recipes", "export", "slurm", "plan", "prepare", "keys", "generate", "chat"}
EXPECTED_SECTIONS = {"description", "model", "lora", "engine", "data", "train", "dpo", "grpo", "launch",
                     "hardware"}


def test_public_surface_snapshot():
    from shardtune.launcher.cli import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert EXPECTED_COMMANDS <= names
    keys = set(recipe_keys())
    assert {k for k in keys if "." not in k} == EXPECTED_SECTIONS
    for k in ["model.config", "model.path", "model.tokenizer", "model.init", "lora.r", "lora.alpha", "lora.quantize_base",
              "lora.target_modules", "engine.backend", "engine.strategy", "engine.hybrid_shard_size", "engine.wrap",
              "engine.mixed_precision", "engine.reduce_dtype", "engine.activation_checkpointing", "engine.cpu_offload",
              "engine.prefetch", "engine.backward_schedule", "engine.offload_activations", "engine.mlp_chunk_tokens", "engine.context_parallel", "engine.compile", "data.path", "data.format", "data.seq_len", "data.packing", "data.cache_dir", "train.output_dir",
              "data.text_field", "data.prompt_field", "data.input_field", "data.response_field", "data.template",
              "data.messages_field", "data.chat_style", "data.train_on_inputs", "model.chat_template", "train.epochs",
              "train.micro_batch_size", "train.grad_accum", "train.max_steps", "train.lr", "train.schedule",
              "train.warmup_steps", "train.weight_decay", "train.max_grad_norm", "train.seed", "train.eval_every",
              "train.save_every", "train.profile_memory", "train.loss_chunk_tokens", "engine.nf4_tile_mb", "train.objective", "data.chosen_field", "data.rejected_field",
              "dpo.beta", "dpo.loss", "dpo.label_smoothing", "dpo.precompute_reference", "dpo.sft_warmup_steps",
              "grpo.num_generations", "grpo.max_new_tokens", "grpo.temperature", "grpo.top_p", "grpo.top_k",
              "grpo.loss_type", "grpo.epsilon", "grpo.epsilon_high", "grpo.beta", "grpo.num_iterations",
              "grpo.scale_rewards", "grpo.reward_funcs", "grpo.reward_weights",
              "launch.nproc_per_node", "launch.nnodes", "launch.device",
              "hardware.gpu", "hardware.num_gpus", "hardware.host_ram_gb"]:
        assert k in keys, k


@pytest.mark.parametrize("value,expected", [("true", True), ("2", 2), ("false", False)])
def test_activation_checkpointing_accepts_bool_or_k(value, expected):
    assert load_recipe("tiny-cpu", [f"engine.activation_checkpointing={value}"]).engine.activation_checkpointing == expected
