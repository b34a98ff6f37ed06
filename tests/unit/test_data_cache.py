"""The tokenized data cache: hits skip tokenization, inputs invalidate it, races and kills cannot corrupt it, rows
equal the in-memory reference, batches are a pure function of (seed, step), and `shardtune prepare` end to end (through the installed executable, and a build SIGKILLed in its own process:
tests/integration/test_installed_executable.py, test_fresh_interpreter.py)."""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import GlobalBatches, build_data, pipeline
from shardtune.data import build as build_mod
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.formats import IGNORE, encode_row
from shardtune.data.packing import pack

TOK = build_char_tokenizer()
SHARDTUNE = Path(sys.executable).with_name("shardtune")


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "user", "content": "u" * rng.randint(1, 5)}]
        if rng.random() < 0.8:  # some chats have no assistant turn: nothing to learn, dropped
            msgs.append({"role": "assistant", "content": "a" * rng.randint(1, 9)})
        out.append({"prompt": "p" * rng.randint(1, 20), "response": "r" * rng.randint(0, 20),
                    "text": "t" * rng.randint(1, 40), "messages": msgs})
    return out


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, path: Path, **kw) -> DataConfig:
    return DataConfig(**{"path": str(path), "format": "instruction", "seq_len": 32, "eval_fraction": 0.1,
                         "cache_dir": str(tmp_path / "cache"), **kw})


def _entries(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if (p / "manifest.json").exists()]


@pytest.fixture
def count_tokenizer_calls(monkeypatch):
    calls = []
    real = build_mod.encode_batch

    def counting(batch, cfg, tok):
        calls.append(len(next(iter(batch.values()))))
        return real(batch, cfg, tok)

    monkeypatch.setattr(build_mod, "encode_batch", counting)  # small data: map runs in this process (num_proc 1)
    return calls


@pytest.mark.parametrize("fmt", ["text", "instruction", "chat"])
@pytest.mark.parametrize("packing", [True, False])
def test_cached_rows_equal_the_in_memory_reference(tmp_path, fmt, packing):
    rows = _rows(120)
    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", rows), format=fmt, packing=packing)
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)  # the documented split: the seed's shuffle, first eval_fraction held out
    num_eval = int(len(rows) * 0.1)
    refs = {split: pack([d for d in (encode_row(rows[i], cfg, TOK) for i in ids) if d[0]], 32, 0, packing)
            for split, ids in (("train", order[num_eval:]), ("eval", order[:num_eval]))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = build_data(cfg, TOK, seed=1)
    t, e = refs["train"].num_truncated, refs["eval"].num_truncated
    assert [str(w.message) for w in caught] == ([f"{t + e} (train {t}, eval {e}) documents longer than "
                                                 "data.seq_len=32 were truncated"] if t + e else [])
    for split, ref in refs.items():
        got = getattr(data, split)
        assert len(got) == len(ref) > 0
        for a, b in zip(got.take(range(len(got))), (ref.input_ids, ref.labels, ref.position_ids)):
            np.testing.assert_array_equal(a, b.numpy())


def test_cache_hit_skips_tokenization(tmp_path, count_tokenizer_calls):
    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(50)))
    first = build_data(cfg, TOK, seed=0)
    assert first.built and sum(count_tokenizer_calls) == 50  # every row tokenized once, none twice
    count_tokenizer_calls.clear()
    again = build_data(cfg, TOK, seed=0)
    assert not again.built and count_tokenizer_calls == [] and again.entry == first.entry
    np.testing.assert_array_equal(again.train.take([0, 3])[0], first.train.take([0, 3])[0])
    assert manifest_token_dtype(again) == "uint16"  # 100 ids: 2 bytes per token on disk


def manifest_token_dtype(data) -> str:
    return data.manifest["token_dtype"]


def test_changed_file_seq_len_or_seed_invalidate(tmp_path, count_tokenizer_calls):
    path = _write(tmp_path / "d.jsonl", _rows(40))
    base = build_data(_cfg(tmp_path, path), TOK, seed=0).entry
    assert build_data(_cfg(tmp_path, path, seq_len=48), TOK, seed=0).entry != base
    assert build_data(_cfg(tmp_path, path), TOK, seed=1).entry != base
    _write(path, _rows(40, seed=7))  # new content (size and mtime change)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    changed = build_data(_cfg(tmp_path, path), TOK, seed=0)
    assert changed.built and changed.entry != base
    assert len(_entries(tmp_path / "cache")) == 4


def test_two_concurrent_builders_do_not_corrupt(tmp_path, monkeypatch):
    """Both miss, both build into their own temp dir, both commit: one rename wins, the other yields to it."""
    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(60)))
    both_built = threading.Barrier(2, timeout=60)
    real = pipeline.build_entry

    def build_then_wait(*a, **kw):
        manifest = real(*a, **kw)
        both_built.wait()  # neither commits before the other has finished building: a guaranteed race
        return manifest

    monkeypatch.setattr(pipeline, "build_entry", build_then_wait)
    results, errors = [], []

    def run():
        try:
            results.append(build_data(cfg, TOK, seed=0))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0].entry == results[1].entry and all(r.built for r in results)
    root = tmp_path / "cache"
    assert _entries(root) == [results[0].entry] and not list(root.glob(".tmp-*"))  # the loser cleaned up
    a, b = (r.train.take(range(len(r.train))) for r in results)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)





# step 0 of builtin:reverse (seed 0, 40 samples, seq_len 48, packed): two documents in the first row
PINNED_ROW = "<s>reverse haae=\neaah</s><s>reverse feafh=\nhfaef</s>" + "<pad>" * 6  # the plain template's "\n"
PINNED_STEPS = {0: [2, 10, 3, 12], 5: [13, 15, 9, 4]}


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path):
    cfg = DataConfig(path="builtin:reverse", format="instruction", seq_len=48, num_samples=40, eval_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, TOK, seed=0)
    gb = GlobalBatches(data.train, micro_batch_size=2, grad_accum=1, world_size=2, seed=0)
    for step, idx in PINNED_STEPS.items():
        assert gb.indices(step).tolist() == idx
    ids, labels, pos = data.train.take(PINNED_STEPS[0][:1])
    assert TOK.decode(ids[0]) == PINNED_ROW
    assert TOK.decode([t for t, lab in zip(ids[0], labels[0]) if lab != IGNORE]) == "eaah</s>hfaef</s>"
    assert pos[0, 20] == 0 and pos[0, 42] == 0  # positions restart at the second document and at the padding

    def global_batch(data, world, accum, step):  # what all ranks of a world train on at `step`, in order
        gb = GlobalBatches(data.train, micro_batch_size=1, grad_accum=accum, world_size=world, seed=0)
        rows = {}
        for rank in range(world):
            micro, total = gb.step(step, rank)
            for a, mb in enumerate(micro):
                rows[a * world + rank] = (mb.input_ids[0].tolist(), total)
        return [rows[k] for k in sorted(rows)]

    resumed = build_data(cfg, TOK, seed=0)  # a restart: a cache hit, fresh objects
    assert not resumed.built
    for step in (0, 7, 30):  # 30 is past the first epoch (18 rows / 4 per step)
        want = global_batch(data, 1, 4, step)
        assert global_batch(data, 2, 2, step) == global_batch(data, 4, 1, step) == want
        assert global_batch(resumed, 2, 2, step) == want


def test_memory_tracker_does_not_see_the_dataset(tmp_path):
    from shardtune.memory import snapshot_live_bytes

    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(200)))
    before = snapshot_live_bytes()
    data = build_data(cfg, TOK, seed=0)
    GlobalBatches(data.train, micro_batch_size=2, grad_accum=1, world_size=1, seed=0).step(0, 0)
    assert len(data.train) > 50 and snapshot_live_bytes() == before  # memory maps and numpy, no tensors


def test_builtin_tasks_equal_the_datasets_path(tmp_path):
    """Builtin tasks are tokenized in-process with pyarrow (that the demo's first run imports neither `datasets` nor
    pandas: tests/integration/test_fresh_interpreter.py); the entry holds the same rows, stats and held-out raw rows
    as the `datasets.map` path used for files."""
    cfg = DataConfig(path="builtin:sort", format="instruction", seq_len=40, num_samples=300, eval_fraction=0.1)
    import datasets

    entries = []
    rows = pipeline.load_raw(cfg, 0)
    for i, raw in enumerate((rows, datasets.Dataset.from_list(rows))):  # the in-process path, then datasets.map
        tmp = tmp_path / f"tmp{i}"
        tmp.mkdir()
        manifest = build_mod.build_entry(raw, cfg, TOK, tmp, seed=0)
        entries.append((manifest["stats"], pipeline.open_entry(pipeline.cache.commit(tmp, tmp_path / f"e{i}", manifest))))
    (stats_a, a), (stats_b, b) = entries
    assert stats_a == stats_b and a.eval_raw == b.eval_raw
    for split in ("train", "eval"):
        rows_a, rows_b = getattr(a, split), getattr(b, split)
        for x, y in zip(rows_a.take(np.arange(len(rows_a))), rows_b.take(np.arange(len(rows_b)))):
            assert np.array_equal(x, y)
