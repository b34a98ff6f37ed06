"""`model.path=DIR` makes DIR the model: a local HF checkpoint folder with its own BPE tokenizer trains with just
`model.path=DIR model.init=pretrained` on the demo recipe (whose own model.config and builtin:char tokenizer yield,
with one line saying so); a folder without config.json is one line, exit 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardtune.config.load import load_recipe
from tests.integration import forked
from tests.integration.runs import FAST, cli, forked_cli, losses
from tests.unit.cli_helpers import run_cli

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def write_checkpoint(folder: Path) -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained with `tokenizers` on a few lines, and a tiny Llama sized to it, saved as HF does."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()  # as GPT-2-style tokenizers ship: decode() gives text back
    corpus = [f"reverse {w}={w[::-1]}" for w in ("abcdef", "hello", "shardtune", "xyzzy", "qwerty")] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", model_input_names=["input_ids", "attention_mask"])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():  # the same weights every run (tests compare its greedy replies)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("own") / "my-model"
    write_checkpoint(folder)
    return folder


def test_model_folder_brings_its_config_and_tokenizer(checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    proc = cli("train", "tiny-cpu", f"model.path={checkpoint}", "model.init=pretrained",
               f"train.output_dir={run_dir}", *FAST, "train.max_steps=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("note: model.path=")]
    assert len(notes) == 2 and "model.config" in notes[0] and "model.tokenizer" in notes[1], proc.stderr[-2000:]
    assert len(losses(run_dir)) == 3
    recipe = load_recipe(run_dir / "recipe.yaml")
    assert recipe.model.config is None and recipe.model.tokenizer is None
    # final/ is the folder's architecture and tokenizer, not the recipe's tiny-llama and builtin:char
    saved = json.loads((run_dir / "final" / "config.json").read_text())
    assert saved["vocab_size"] == json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    text = "reverse hello=olleh"
    assert (AutoTokenizer.from_pretrained(run_dir / "final")(text)["input_ids"]
            == AutoTokenizer.from_pretrained(checkpoint)(text)["input_ids"])


def test_explicit_command_line_keys_still_win(checkpoint, tmp_path, capsys):
    from shardtune.config.load import load_recipe_config

    cfg = load_recipe_config("tiny-cpu", [f"model.path={checkpoint}", "model.tokenizer=builtin:char"])
    assert cfg.model.tokenizer == "builtin:char" and cfg.model.config is None
    assert "model.tokenizer" not in capsys.readouterr().err


def test_folder_without_config_is_one_line(checkpoint, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    proc = forked_cli("validate", "tiny-cpu", f"model.path={bare}", "model.init=pretrained", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_a_config_that_does_not_describe_the_weights_is_one_line(checkpoint, tmp_path, capsys):
    """The folder's weights beside a config.json of another size (intermediate 256, its weights 128): validate
    reads the files' headers, and the workers check them before loading (each rank's loader failed with a copy
    error, reported as an internal error). One line naming the weight, both shapes; exit 2."""
    folder = tmp_path / "resized"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    code, _, err = run_cli(["validate", "tiny-cpu", f"model.path={folder}", "model.init=pretrained"], capsys)
    said = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(said) == 1, err
    assert "model.layers.0.mlp.gate_proj.weight as [128, 64]" in said[0] and "makes it [256, 64]" in said[0], said
    run = forked.train("tiny-cpu", f"model.path={folder}", "model.init=pretrained", *FAST,
                       f"train.output_dir={tmp_path / 'run'}")
    assert run.code == 2 and [ln for ln in run.err.splitlines() if ln.strip()] == said, run.err[-2000:]


def test_a_tokenizer_without_eos_or_pad_trains_and_evaluates_with_one_warning(tmp_path):
    """A BPE tokenizer saved with no special tokens: padding (the demo eval's generation batches) takes its id 0,
    masked out; one warning says answers have no end marker (the eval's generation crashed with transformers'
    "Asking to pad but the tokenizer does not have a padding token", an internal error)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["reverse abc=cba"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(folder)
    config = json.loads(Path(load_recipe("tiny-cpu").model.config).read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    run = forked.train("tiny-cpu", f"model.tokenizer={folder}", f"model.config={tmp_path / 'config.json'}", *FAST,
                       "train.max_steps=2", "train.demo_eval=true", "train.demo_eval_samples=2",
                       f"train.output_dir={tmp_path / 'run'}")
    assert run.code == 0, run.err[-2000:]
    warned = [ln for ln in run.err.splitlines() if "has no eos_token" in ln]
    assert len(warned) == 1 and warned[0].startswith("warning: model.tokenizer:"), run.err[-2000:]
    assert "accuracy_after" in json.loads((tmp_path / "run" / "summary.json").read_text())
