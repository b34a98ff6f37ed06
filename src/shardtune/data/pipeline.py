"""`data.path` -> a tokenized cache entry (built once, see cache.py / build.py) -> memory-mapped train/eval rows.

`build_data` is the one entry point: it returns the entry when it exists (no tokenization at all), else builds
it. In a training job rank 0 builds and the others wait (`prepare_for_ranks`): see that function for why.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data import cache, synthetic
from shardtune.data.build import build_entry, warn_truncated
from shardtune.data.rows import PackedRows, open_documents
from shardtune.errors import UserError

SUFFIX_TO_BUILDER = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


@dataclass
class TokenizedData:
    train: PackedRows
    eval: PackedRows
    eval_raw: list[dict[str, Any]]  # held-out raw rows, up to build.EVAL_RAW_KEEP (the demo decodes their prompts)
    entry: Path  # the cache entry the rows are mapped from
    manifest: dict[str, Any]
    built: bool  # True when this call tokenized (a cache miss)


def build_data(cfg: DataConfig, tok: PreTrainedTokenizerBase, *, seed: int, output_dir: str | None = None,
               progress: Callable[[int, int], None] | None = None) -> TokenizedData:
    entry, built = ensure_entry(cfg, tok, seed=seed, output_dir=output_dir, progress=progress)
    return open_entry(entry, built=built)


def ensure_entry(cfg: DataConfig, tok: PreTrainedTokenizerBase, *, seed: int, output_dir: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> tuple[Path, bool]:
    """The cache entry for (data, tokenizer, settings): found, or built now. Returns (entry, built)."""
    root = cache.cache_root(cfg, output_dir)
    key = cache.cache_key(cfg, tok, seed)
    entry = root / key
    if cache.read_manifest(entry) is not None:
        return entry, False
    tmp = cache.new_temp_dir(root, key)
    try:
        manifest = build_entry(load_raw(cfg, seed, scratch=tmp / "raw"), cfg, tok, tmp, seed=seed,
                               progress=progress)
        manifest["key"] = key
        cache.commit(tmp, entry, manifest)
    finally:
        if tmp.exists():  # a failed build (bad data, interrupt) leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, True


def open_entry(entry: Path, *, built: bool = False) -> TokenizedData:
    manifest = cache.read_manifest(entry)
    assert manifest is not None, f"{entry} is not a finished cache entry"
    documents = open_documents(entry, manifest["files"])
    train = PackedRows(entry, "train", documents, manifest)
    warn_truncated(train.num_truncated, train.seq_len)
    with open(entry / "eval_raw.jsonl") as f:
        eval_raw = [json.loads(line) for line in f]
    return TokenizedData(train=train, eval=PackedRows(entry, "eval", documents, manifest), eval_raw=eval_raw,
                         entry=entry, manifest=manifest, built=built)


def load_raw(cfg: DataConfig, seed: int, *, scratch: Path | None = None) -> Any:
    """The rows as a `datasets.Dataset` (Arrow, memory-mapped), or for builtin tasks a list of dicts. `scratch`
    holds datasets' Arrow copy of the input files, deleted with the build's temp dir (not piling up in ~/.cache)."""
    if cfg.path is None:
        raise UserError("data.path: not set: give a jsonl/json/parquet/txt file or folder, a saved dataset, "
                        "or builtin:reverse")
    if cfg.path.startswith("builtin:"):
        # A few thousand generated rows: a list, tokenized in this process (build.py), so the demo's first run
        # imports neither `datasets` nor pandas (~0.7 s of its time to first step).
        name = cfg.path.split(":", 1)[1]
        try:
            return synthetic.generate(name, cfg.num_samples, seed)
        except KeyError:
            raise UserError(f"data.path: unknown builtin task '{name}': choose from "
                            f"{sorted(synthetic.TASKS)}") from None
    import datasets  # heavy import, only when a file is read

    datasets.disable_progress_bars()  # one bar per rank is noise in logs
    path = Path(cfg.path)
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        else:
            files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIX_TO_BUILDER) if path.is_dir() else [path]
            if not files:
                raise UserError(f"data.path: no .jsonl/.json/.parquet/.txt/.csv files in '{path}'")
            builder = SUFFIX_TO_BUILDER.get(files[0].suffix)
            if builder is None:
                raise UserError(f"data.path: '{path.name}' has an unknown suffix: use .jsonl, .json, .parquet, .txt or .csv")
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                      cache_dir=str(scratch) if scratch else None)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable files
        detail = (str(e).strip().splitlines() or ["no details"])[0][:120]
        raise UserError(f"data.path: cannot read '{path}' ({type(e).__name__}: {detail}): check the file's format "
                        "and encoding (UTF-8)") from None
    return ds
