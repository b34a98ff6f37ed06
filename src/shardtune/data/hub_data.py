"""`data.path=OWNER/NAME[@REVISION]`: a dataset on the Hugging Face Hub, used like a local one.

The repo's data files are fetched once into the HF cache (hub.dataset_dir). `datasets` then reads the snapshot as
a folder, by its own rules: the dataset card's `configs` (subsets, their split names and files; `data.subset`
picks one when there is no default) or the file-name conventions (train-*.parquet, test-*.jsonl...). The recipe's
`data.split` (default train) is saved with
`save_to_disk`, once per snapshot commit, under HF_DATASETS_CACHE/shardtune/. From there every reader (validate's
checks, the tokenized cache build, each rank) reads a saved dataset, as for a local one. The recipe keeps the id,
so a rerun finds the same files.

The launcher resolves the id before any worker starts, so the workers find the saved split. Any other process
that gets there first writes its own copy and renames it into place; the first rename wins.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from shardtune.errors import UserError


def pick_split(ds: Any, split: str, where: str) -> Any:
    """One split of a DatasetDict: `split`; without one of that name, the default `train` takes the only split of a
    dict of one; otherwise one line listing the splits."""
    import datasets

    if not isinstance(ds, datasets.DatasetDict):
        return ds
    if split in ds:
        return ds[split]
    if split == "train" and len(ds) == 1:
        return next(iter(ds.values()))
    raise UserError(f"data.split: '{split}' is not a split of {where} (its splits: {', '.join(ds)}): set "
                    f"data.split to one of them")


@functools.cache  # sources() asks on every data read of a process: look the cache up once
def saved_split(path: str, split: str, subset: str | None = None) -> Path:
    """The saved-dataset folder of `split` (of `subset`) of the Hub dataset `path` (fetched and saved on first use)."""
    import datasets

    from shardtune.hub import dataset_dir

    datasets.disable_progress_bars()  # "Generating train split" and "Saving the dataset" bars: noise in a log
    snapshot = dataset_dir(path)
    repo = path.partition("@")[0].replace("/", "--")
    out = Path(datasets.config.HF_DATASETS_CACHE) / "shardtune" / repo / snapshot.name / (subset or "default") / split
    if (out / "dataset_info.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{split}-") as tmp:
        try:
            ds = datasets.load_dataset(str(snapshot), subset, cache_dir=str(Path(tmp) / "cache"))
        except (ValueError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            if "Config name is missing" in str(e):  # a card with several subsets and no default
                raise UserError(f"data.subset: the Hub dataset '{path}' has several subsets and no default "
                                f"({first}): set data.subset=NAME") from None
            if subset is not None and "not found" in str(e):
                raise UserError(f"data.subset: '{subset}' is not a subset of the Hub dataset '{path}' ({first}): "
                                "set data.subset to one of them") from None
            raise UserError(f"data.path: the Hub dataset '{path}' has no data files shardtune can read ({first}): "
                            "it needs .parquet, .jsonl, .json, .csv or .txt files in the repo") from None
        ds = pick_split(ds, split, f"the Hub dataset '{path}'")
        ds.save_to_disk(str(Path(tmp) / "saved"))
        try:
            os.replace(Path(tmp) / "saved", out)
        except OSError:  # another process saved it first: keep theirs
            if not (out / "dataset_info.json").is_file():
                raise
            shutil.rmtree(Path(tmp) / "saved", ignore_errors=True)
    return out
