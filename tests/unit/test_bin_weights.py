"""A model folder with PyTorch .bin weights (model/bin_weights.py): validate reads it like safetensors (its shapes
checked against the config), and a .bin the loader cannot map, or that holds no state dict, is one line naming the
file; a folder with no weights at all names both formats. (Loading parity: tests/distributed/test_loading.py.)"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.unit.cli_helpers import run_cli


def _folder(tmp_path: Path, save) -> Path:
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    save(LlamaForCausalLM(config).state_dict(), folder / "pytorch_model.bin")
    return folder


def _validate(folder: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code, _, err = run_cli(["validate", "tiny-cpu", f"model.path={folder}", "model.init=pretrained",
                            f"train.output_dir={tmp_path / 'run'}"], capsys)
    return code, err


def test_a_bin_checkpoint_validates(tmp_path, capsys):
    code, err = _validate(_folder(tmp_path, torch.save), tmp_path, capsys)
    assert code == 0, err


def test_a_bin_of_another_size_is_caught_by_the_shape_check(tmp_path, capsys):
    folder = _folder(tmp_path, torch.save)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    code, err = _validate(folder, tmp_path, capsys)
    assert code == 2 and "pytorch_model.bin" in err and "[64, 32]" in err and "[96, 32]" in err, err


@pytest.mark.parametrize("save,says", [
    (lambda sd, f: torch.save(sd, f, _use_new_zipfile_serialization=False), "re-save it"),  # torch < 1.6 format
    (lambda sd, f: torch.save(list(sd.values()), f), "not a state dict"),
    (lambda sd, f: f.write_bytes(pickle.dumps({"w": Path("x")})), "cannot be read"),  # not weights_only-safe
], ids=["legacy_format", "a_list", "arbitrary_pickle"])
def test_an_unreadable_bin_is_one_line(tmp_path, capsys, save, says):
    code, err = _validate(_folder(tmp_path, save), tmp_path, capsys)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("note:")]
    assert code == 2 and len(lines) == 1 and "pytorch_model.bin" in lines[0] and says in lines[0], err


def test_a_folder_without_weights_names_both_formats(tmp_path, capsys):
    folder = _folder(tmp_path, torch.save)
    (folder / "pytorch_model.bin").unlink()
    code, err = _validate(folder, tmp_path, capsys)
    assert code == 2 and "*.safetensors" in err and "pytorch_model*.bin" in err, err
