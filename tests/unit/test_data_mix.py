"""Several datasets mixed by weight (data/mix.py, data/sources.py) and train.epochs."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from shardtune.config.load import load_recipe
from shardtune.config.schema import DataConfig, TrainConfig
from shardtune.data import GlobalBatches, build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.mix import MixedRows, apportion
from shardtune.errors import UserError
from shardtune.trainer.train import steps_for

TOK = build_char_tokenizer()


class Tagged:
    """A row source whose row r of dataset k reads as [k, r]: which dataset and row each batch row came from."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n

    def __len__(self) -> int:
        return self.n

    def take(self, idx):
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        ids = np.stack([np.full(len(idx), self.k), idx], axis=1)
        return ids, ids.copy(), np.zeros_like(ids)


def _sources_of(batches: GlobalBatches, steps: range) -> list[tuple[int, int]]:
    ids = np.concatenate([batches.rows.take(batches.indices(s))[0] for s in steps])
    return [tuple(r) for r in ids.tolist()]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 3], [5, 1]])
def test_mix_ratio_within_2_percent_of_the_weights_over_1000_rows(weights):
    mix = MixedRows([Tagged(0, 250), Tagged(1, 900)], weights, seed=0)
    batches = GlobalBatches(mix, micro_batch_size=5, grad_accum=2, world_size=2, seed=0)  # 20 rows per step
    for start in (0, 37, 120):  # any 1,000-row window, past the first epoch of the mix too (1,150 rows)
        counts = Counter(k for k, _ in _sources_of(batches, range(start, start + 50)))
        for k, w in enumerate(weights):
            assert abs(counts[k] / 1000 - w / sum(weights)) <= 0.02, (weights, start, counts)


def test_mix_is_world_size_free_and_walks_each_dataset_before_repeating():
    mix = MixedRows([Tagged(0, 30), Tagged(1, 200)], [3, 1], seed=4)
    seen = {}
    for world, accum in [(1, 4), (2, 2), (4, 1)]:
        gb = GlobalBatches(mix, micro_batch_size=2, grad_accum=accum, world_size=world, seed=4)
        rows = []
        for step in range(40):
            for rank in range(world):
                micro, _ = gb.step(step, rank)
                rows += [tuple(r.tolist()) for mb in micro for r in mb.input_ids]
        seen[(world, accum)] = sorted(rows)
    assert seen[(1, 4)] == seen[(2, 2)] == seen[(4, 1)]
    again = MixedRows([Tagged(0, 30), Tagged(1, 200)], [3, 1], seed=4)  # a resumed run: same rows at each position
    assert np.array_equal(again.take(np.arange(500, 560))[0], mix.take(np.arange(500, 560))[0])
    small = [r for k, r in _sources_of(GlobalBatches(mix, micro_batch_size=1, grad_accum=1, world_size=1, seed=4),
                                       range(230)) if k == 0]  # the up-weighted small dataset, 30 rows
    for cycle in range(len(small) // 30):
        assert sorted(small[cycle * 30 : (cycle + 1) * 30]) == list(range(30))  # every row once per pass
    assert apportion(10, [1, 1, 1]) == [4, 3, 3] and apportion(3, [100, 1]) == [2, 1]


def test_two_files_mix_through_the_cache_and_share_entries_with_single_runs(tmp_path):
    for name, n in (("a", 60), ("b", 20)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}{i}"}) + "\n" for i in range(n)))
    mix_path = [{"path": str(tmp_path / "a.jsonl"), "weight": 1}, {"path": str(tmp_path / "b.jsonl"), "weight": 3}]
    common = {"format": "text", "seq_len": 16, "packing": False, "eval_fraction": 0.1, "cache_dir": str(tmp_path / "c")}
    data = build_data(DataConfig(path=mix_path, **common), TOK, seed=0)
    assert len(data.parts) == 2 and len(data.eval) == 6 + 2
    ids = data.train.take(np.arange(400))[0]
    first = Counter(TOK.decode([int(ids[i, 1])]) for i in range(400))
    assert abs(first["b"] / 400 - 0.75) <= 0.02
    alone = build_data(DataConfig(path=str(tmp_path / "b.jsonl"), **common), TOK, seed=0)
    assert not alone.built and alone.entry == data.parts[1].entry  # the mix's part is the single run's cache


def test_mix_recipe_keys_are_checked(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    base = "model:\n  config: configs/models/tiny-llama.json\ndata:\n  path:\n"
    cases = {"    - {path: a.jsonl, formt: chat}\n": "data.path[0].formt",
             "    - {path: a.jsonl}\n    - {path: a.jsonl, weight: -1}\n": "data.path[1].weight",
             "    - {path: a.jsonl, template: nothing}\n": "data.path[0].template",
             "    - {path: missing.jsonl}\n": "missing.jsonl",
             "    - {weight: 2}\n": "data.path[0]"}
    for body, needle in cases.items():
        recipe = tmp_path / "r.yaml"
        recipe.write_text(base + body)
        with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            load_recipe(recipe)
    recipe.write_text(base + "    - {path: a.jsonl, weight: 2, format: text}\n")
    assert load_recipe(recipe).data.path[0]["path"] == str((tmp_path / "a.jsonl").resolve())


def test_epochs_or_max_steps():
    assert TrainConfig().max_steps == 100 and TrainConfig(epochs=2).max_steps is None
    with pytest.raises(ValueError, match="train.epochs"):
        TrainConfig(epochs=1, max_steps=10)
    assert steps_for(TrainConfig(epochs=2), num_rows=100, global_size=16, announce=False) == 13  # ceil(200 / 16)
    assert steps_for(TrainConfig(max_steps=7), num_rows=100, global_size=16, announce=False) == 7
    with pytest.warns(UserWarning, match="warmup_steps=20 >= the run's 13 steps"):
        steps_for(TrainConfig(epochs=2, warmup_steps=20), num_rows=100, global_size=16, announce=True)
