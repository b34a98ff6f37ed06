"""generation_config.json beside an exported full model (checkpoint/generation.py): built from the model config with
the tokenizer's ids, so `from_pretrained(...).generate()` stops at the eos the run trained with and pads with its
pad; a model's own generation config is kept, its stop ids too."""
from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from shardtune.checkpoint.generation import GENERATION_CONFIG, with_tokenizer_ids, write_generation_config
from tests.integration.test_model_folder import write_checkpoint


def test_a_folder_without_one_gets_the_tokenizers_ids_and_generates(tmp_path):
    tok = write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(eos_token_id=None, pad_token_id=None, bos_token_id=None)  # an architecture file names none
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / GENERATION_CONFIG).unlink()
    write_generation_config(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (tok.eos_token_id, tok.pad_token_id,
                                                                      tok.bos_token_id)
    ids = tok("reverse abc=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)  # no eos or pad passed: the file's are used
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 4


def test_the_models_own_stop_ids_are_kept_and_one_already_there_is_not_replaced(tmp_path):
    tok = write_checkpoint(tmp_path)
    gen = with_tokenizer_ids(GenerationConfig(eos_token_id=[7, 9], pad_token_id=5, temperature=0.6, do_sample=True),
                             tok)
    assert (gen.eos_token_id, gen.pad_token_id, gen.temperature) == ([7, 9, tok.eos_token_id], 5, 0.6)
    gen.save_pretrained(tmp_path)
    write_generation_config(tmp_path)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [7, 9, tok.eos_token_id]


def test_a_model_config_alone_when_no_tokenizer_is_beside_it(tmp_path):
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, eos_token_id=3)).save_pretrained(tmp_path)
    (tmp_path / GENERATION_CONFIG).unlink()
    write_generation_config(tmp_path)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == 3
