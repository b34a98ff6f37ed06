"""Data: prompt masking, chat masking, packing without cross-document attention, world-size-free batches."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.bundled import CONFIGS_DIR
from shardtune.config.schema import DataConfig, ModelConfig
from shardtune.data import GlobalBatches, build_data
from shardtune.data.batches import num_targets
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.formats import IGNORE, encode_row
from shardtune.data.packing import pack
from shardtune.model.build import load_config

TOK = build_char_tokenizer()


def test_instruction_masks_prompt():
    ids, labels = encode_row({"prompt": "reverse ab=", "response": "ba"}, DataConfig(format="instruction"), TOK)
    n_prompt = 1 + len("reverse ab=\n")  # bos + prompt characters + the plain template's separator
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:] == TOK("ba", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]


def test_chat_trains_only_assistant_turns():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    ids, labels = encode_row({"messages": msgs}, DataConfig(format="chat"), TOK)
    trained = TOK.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])
    assert trained == "yo</s>ok</s>"
    assert ids == list(TOK.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])


def test_packing_resets_positions_and_masks_boundaries():
    docs = [([1, 10, 11, 2], [1, 10, 11, 2]), ([1, 20, 2], [IGNORE, 20, 2]), ([1, 30, 31, 32, 33, 2], [1] * 6)]
    rows = pack(docs, seq_len=8, pad_id=0, packing=True)
    assert rows.input_ids.shape == (2, 8)  # doc 3 does not fit after docs 1+2: it starts a new row, never split
    assert rows.input_ids[0].tolist() == [1, 10, 11, 2, 1, 20, 2, 0]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert rows.labels[0].tolist() == [IGNORE, 10, 11, 2, IGNORE, 20, 2, IGNORE]
    unpacked = pack(docs, seq_len=8, pad_id=0, packing=False)
    assert unpacked.input_ids.shape == (3, 8)


def test_truncation_is_counted():
    rows = pack([([5] * 20, [5] * 20)], seq_len=8, pad_id=0, packing=True)
    assert rows.num_truncated == 1 and rows.input_ids.shape == (1, 8)


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_do_not_attend_to_each_other(model_name, attn):
    cfg = AutoConfig.from_pretrained(CONFIGS_DIR / f"models/{model_name}.json")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    a, b = torch.randint(4, 100, (5,)), torch.randint(4, 100, (7,))
    packed = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():  # use_cache=False as in training: HF skips packed detection when a cache exists
        joint = model(input_ids=packed, position_ids=pos, use_cache=False).logits[0, 5:]
        alone = model(input_ids=b[None], position_ids=torch.arange(7)[None], use_cache=False).logits[0]
        leaky = model(input_ids=packed, use_cache=False).logits[0, 5:]  # same tokens without the position reset
    torch.testing.assert_close(joint, alone, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(leaky, alone, atol=1e-3)  # the check can fail: without resets doc b sees doc a


def _rows(n: int):
    docs = [([1] + [4 + (i % 50)] * (1 + i % 5) + [2], [IGNORE] + [4 + (i % 50)] * (1 + i % 5) + [2]) for i in range(n)]
    return pack(docs, seq_len=8, pad_id=0, packing=False)


def test_global_batch_is_independent_of_world_size():
    rows = _rows(50)
    seen = {}
    for world, accum in [(1, 4), (2, 2), (4, 1)]:
        gb = GlobalBatches(rows, micro_batch_size=2, grad_accum=accum, world_size=world, seed=3)
        per_step = []
        for step in range(30):  # > one epoch (50 rows / 8 per step): wraps into a new permutation
            got, total = [], None
            for rank in range(world):
                micro, total_r = gb.step(step, rank)
                assert total is None or total == total_r  # every rank counts the same global targets
                total = total_r
                got += [tuple(r.tolist()) for mb in micro for r in mb.input_ids]
            per_step.append((sorted(got), total))
        seen[(world, accum)] = per_step
    assert seen[(1, 4)] == seen[(2, 2)] == seen[(4, 1)]


def test_epoch_covers_every_row_once():
    rows = _rows(40)
    gb = GlobalBatches(rows, micro_batch_size=2, grad_accum=2, world_size=2, seed=0)
    idx = np.concatenate([gb.indices(s) for s in range(5)])  # 5 steps x 8 = 40 rows = one epoch
    assert sorted(idx.tolist()) == list(range(40))
    assert num_targets(rows.labels[idx]) == num_targets(rows.labels)


_CODECS = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "txt", "saved", "saved_splits", "jsonl.gz", "csv.bz2", "txt.xz"])
def test_loads_files_and_saved_datasets(tmp_path, suffix):
    import datasets

    texts = [f"hello world {i}" for i in range(20)]
    path = tmp_path / f"d.{suffix}"
    if suffix.rsplit(".", 1)[-1] in _CODECS:  # compressed text formats: read through their codec
        fmt, codec = suffix.rsplit(".", 1)
        body = {"jsonl": "".join(json.dumps({"text": t}) + "\n" for t in texts),
                "csv": "text\n" + "\n".join(texts) + "\n", "txt": "\n".join(texts) + "\n"}[fmt]
        with _CODECS[codec](path, "wt") as f:
            f.write(body)
    elif suffix == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif suffix == "txt":
        path.write_text("\n".join(texts) + "\n")
    elif suffix == "parquet":
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(path))
    elif suffix == "saved":
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    else:  # a DatasetDict: its train split is read (the folder's own files were read as data files before)
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                              "test": datasets.Dataset.from_dict({"text": ["not this"] * 5})}).save_to_disk(str(path))
    data = build_data(DataConfig(path=str(path), format="text", seq_len=32, eval_fraction=0.1, packing=False), TOK, seed=0)
    assert len(data.eval_raw) == 2
    decoded = {TOK.decode([t for t in row.tolist() if t > 3]) for row in data.train.take(range(len(data.train)))[0]}
    assert decoded <= set(texts) and len(decoded) >= 10


@pytest.mark.parametrize("name,says", [
    ("cut.jsonl.gz", "cannot be decompressed"), ("blank.jsonl.gz", "is empty"), ("rows.parquet.gz", "unknown suffix"),
    ("bad.jsonl.gz", "line 2, column"),
])
def test_a_bad_compressed_file_is_one_line(tmp_path, name, says):
    from shardtune.data.check import check_data_head
    from shardtune.errors import UserError

    path = tmp_path / name
    good = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(200))
    body = {"cut": gzip.compress(good.encode())[:60], "blank": gzip.compress(b"\n \n"), "rows": b"x",
            "bad": gzip.compress(b'{"text": "a"}\n{"text" "b"}\n')}[name.split(".")[0]]
    path.write_bytes(body)
    cfg = DataConfig(path=str(path), format="text", seq_len=32)
    for check in (lambda: check_data_head(cfg), lambda: build_data(cfg, TOK, seed=0)):  # validate's, and the load's
        with pytest.raises(UserError, match=says) as e:
            check()
        assert name in str(e.value) and "\n" not in str(e.value)


def test_a_subset_for_a_local_file_is_ignored_with_a_warning(tmp_path):
    from shardtune.data.sources import sources

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.warns(UserWarning, match="data.subset=main is ignored"):
        (src, _), = sources(DataConfig(path=str(path), subset="main"))
    assert src.path == str(path)


def test_missing_column_is_a_user_error(tmp_path):
    from shardtune.errors import UserError

    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match="column"):
        build_data(DataConfig(path=str(path), format="text"), TOK, seed=0)


def test_model_config_error_names_key(tmp_path):
    from shardtune.errors import UserError

    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="model.config"):
        load_config(ModelConfig(config=str(bad)))


def test_data_problems_are_clear(tmp_path):
    from shardtune.errors import UserError

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="data.path: .* is empty: give a file with at least one row"):
        build_data(DataConfig(path=str(empty), format="text"), TOK, seed=0)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 5)
    with pytest.raises(UserError, match="data.path"):
        build_data(DataConfig(path=str(latin), format="text"), TOK, seed=0)
    long_rows = tmp_path / "long.jsonl"
    long_rows.write_text("".join(json.dumps({"text": "x" * 100}) + "\n" for _ in range(10)))
    with pytest.warns(UserWarning, match=r"10 \(train 10, eval 0\) documents longer than data.seq_len=16 were truncated"):
        build_data(DataConfig(path=str(long_rows), format="text", seq_len=16, eval_fraction=0.0), TOK, seed=0)
    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text("".join(json.dumps({"prompt": "p" * 40, "response": "r"}) + "\n" for _ in range(4)))
    with pytest.raises(UserError, match="no target tokens"), pytest.warns(UserWarning):
        build_data(DataConfig(path=str(prompts_only), format="instruction", seq_len=16, eval_fraction=0.0), TOK,
                   seed=0)
