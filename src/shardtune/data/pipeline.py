"""`data.path` -> a tokenized cache entry (built once, see cache.py / build.py) -> memory-mapped train/eval rows.

`build_data` is the one entry point: it returns the entry when it exists (no tokenization at all), else builds
it. In a training job rank 0 builds and the others wait (`prepare_for_ranks`): see that function for why.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardtune import synthetic
from shardtune.config.schema import DataConfig
from shardtune.data import cache
from shardtune.data.batches import RowSource
from shardtune.data.build import build_entry, interrupt_between_pieces, warn_truncated
from shardtune.data.hub_data import pick_split
from shardtune.data.mix import ConcatRows, MixedRows
from shardtune.data.rows import PackedRows, open_documents
from shardtune.data.sample import (
    SUFFIX_TO_BUILDER,
    check_not_empty,
    check_utf8,
    data_files,
    data_suffix,
    find_bad_json_line,
    is_saved_dataset,
)
from shardtune.data.sources import is_mix, sources
from shardtune.errors import UserError


@dataclass
class TokenizedData:
    train: RowSource  # PackedRows of one cache entry, or MixedRows over several
    eval: RowSource
    eval_raw: list[dict[str, Any]]  # held-out raw rows, up to build.EVAL_RAW_KEEP (the demo decodes their prompts)
    entry: Path  # the cache entry the rows are mapped from (a mix: its first dataset's)
    manifest: dict[str, Any]  # a mix: {} (each part has its own)
    built: bool  # True when this call tokenized (a cache miss)
    parts: list[TokenizedData] = field(default_factory=list)  # a mix: each dataset, in data.path order
    weights: list[float] = field(default_factory=list)


def build_data(cfg: DataConfig, tok: PreTrainedTokenizerBase, *, seed: int, output_dir: str | None = None,
               progress: Callable[[int, int], None] | None = None) -> TokenizedData:
    """Every dataset of `data.path` built (or found), then opened: one dataset, or their weighted mix."""
    entries = [ensure_entry(src, tok, seed=seed, output_dir=output_dir, progress=progress) for src, _ in sources(cfg)]
    return open_entries(cfg, entries, seed=seed)


def open_entries(cfg: DataConfig, entries: list[tuple[Path, bool]], *, seed: int) -> TokenizedData:
    parts = [open_entry(entry, built=built) for entry, built in entries]
    if not is_mix(cfg):
        return parts[0]
    weights = [w for _, w in sources(cfg)]
    return TokenizedData(train=MixedRows([p.train for p in parts], weights, seed=seed),
                         eval=ConcatRows([p.eval for p in parts]), eval_raw=[], entry=parts[0].entry, manifest={},
                         built=any(p.built for p in parts), parts=parts, weights=weights)


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
        # Ctrl-C is recorded, not raised, for the whole build: a KeyboardInterrupt raised inside datasets' JSON
        # loading or map was swallowed there (the build ran on and exited 0); it is raised at the next check.
        with interrupt_between_pieces() as interrupted:
            raw = load_raw(cfg, seed, scratch=tmp / "raw")
            interrupted.check()
            manifest = build_entry(raw, cfg, tok, tmp, seed=seed, progress=progress)
            interrupted.check()
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
    warn_truncated(manifest["stats"], train.seq_len)
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
                            f"{synthetic.names()}") from None
    import datasets  # heavy import, only when a file is read

    datasets.disable_progress_bars()  # one bar per rank is noise in logs
    datasets.utils.logging.set_verbosity(50)  # CRITICAL: its "Failed to load JSON" error log would precede our line
    path = Path(cfg.path)
    files: list[Path] = []
    try:
        if is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = pick_split(ds, cfg.split, f"the saved dataset '{path}'")
        else:
            files = data_files(path)
            for f in files:
                check_not_empty(f)
                check_utf8(f)
            builder = SUFFIX_TO_BUILDER[data_suffix(files[0])]
            # A UTF-8 BOM is skipped by the json and csv readers; the text reader would keep it in the first row.
            bom = {"encoding": "utf-8-sig"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                       cache_dir=str(scratch) if scratch else None, **bom)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable files: find the line when we can
        for f in files if files and SUFFIX_TO_BUILDER[data_suffix(files[0])] == "json" else []:
            bad = find_bad_json_line(f) if data_suffix(f) == ".jsonl" else None
            if bad is not None:
                raise bad from None
        detail = (str(e).strip().splitlines() or ["no details"])[0][:120]
        raise UserError(f"data.path: cannot read '{path}' ({type(e).__name__}: {detail}): check the file's format "
                        "and encoding (UTF-8); `shardtune validate` names the line") from None
    return ds
