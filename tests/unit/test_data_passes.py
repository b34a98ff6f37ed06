"""A run that goes over its data more than once says so (trainer/data_passes.py): train's first lines, and `validate`
once the data cache counts the rows. (The executable's train line: tests/integration/test_checkpoint.py's SIGTERM
run.)"""
from __future__ import annotations

from shardtune.config.schema import TrainConfig
from shardtune.trainer.data_passes import repeat_notice
from shardtune.trainer.train import steps_for
from tests.unit.cli_helpers import run_cli

# The case: 50 rows, 30 steps of 4 rows.
LINE = ("data: 50 training rows -> 30 steps x 4 rows = 2.4 epochs: each row is seen 2.4 times on average "
        "(train.epochs=N sizes a run in passes over the data instead of train.max_steps)")


def test_more_than_one_pass_is_one_line_and_one_pass_is_none():
    assert repeat_notice(num_rows=50, steps=30, global_size=4) == LINE
    assert repeat_notice(num_rows=50, steps=13, global_size=4).split(": each")[0].endswith("= 1.04 epochs")
    assert repeat_notice(num_rows=3, steps=1000, global_size=1000).split(": each")[0].endswith("= 333,333.33 epochs")
    assert repeat_notice(num_rows=52, steps=13, global_size=4) is None  # exactly once
    assert repeat_notice(num_rows=50, steps=5, global_size=4) is None


def test_train_says_it_once_for_max_steps_and_not_for_epochs(capsys):
    assert steps_for(TrainConfig(max_steps=30, warmup_steps=0), num_rows=50, global_size=4, announce=True) == 30
    assert capsys.readouterr().out == LINE + "\n"
    steps_for(TrainConfig(max_steps=30, warmup_steps=0), num_rows=50, global_size=4, announce=False)  # rank != 0
    steps_for(TrainConfig(max_steps=10, warmup_steps=0), num_rows=50, global_size=4, announce=True)  # 0.8 epochs
    assert capsys.readouterr().out == ""
    steps_for(TrainConfig(epochs=3, warmup_steps=0), num_rows=50, global_size=4, announce=True)
    assert capsys.readouterr().out == "train.epochs=3: 38 steps of 4 rows over 50 training rows\n"  # said already


def test_validate_says_it_once_the_cache_counts_the_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("".join(f"note number {i}\n" for i in range(50)))
    args = ["tiny-cpu", "data.path=notes.txt", "data.format=text", "data.packing=false", "data.eval_fraction=0",
            "train.micro_batch_size=2", "train.max_steps=30", "train.warmup_steps=0",
            f"train.output_dir={tmp_path / 'run'}"]
    code, out, err = run_cli(["validate", *args], capsys)
    assert code == 0 and out.startswith("ok:") and "epochs" not in out, (out, err)  # no cache: no row count yet
    code, out, err = run_cli(["prepare", *args], capsys)
    assert code == 0 and "in 50 rows of 128" in out, (out, err)
    code, out, err = run_cli(["validate", *args], capsys)
    assert code == 0 and out.splitlines()[1:] == [LINE], (out, err)
    code, out, err = run_cli(["validate", *args, "train.max_steps=10"], capsys)  # 40 of 50 rows: once
    assert code == 0 and len(out.splitlines()) == 1, (out, err)

