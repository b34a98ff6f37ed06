"""`data.path` -> tokenized, packed train/eval rows. Loading goes through `datasets`."""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data import synthetic
from shardtune.data.formats import encode_row
from shardtune.data.packing import Rows, pack
from shardtune.errors import UserError

SUFFIX_TO_BUILDER = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


@dataclass
class TokenizedData:
    train: Rows
    eval: Rows
    eval_raw: list[dict[str, Any]]  # held-out raw rows (the demo's accuracy check decodes from their prompts)


def load_raw(cfg: DataConfig, seed: int) -> list[dict[str, Any]]:
    if cfg.path is None:
        raise UserError("data.path: not set: give a jsonl/json/parquet/txt file or folder, a saved dataset, "
                        "or builtin:reverse")
    if cfg.path.startswith("builtin:"):
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
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable files
        detail = (str(e).strip().splitlines() or ["no details"])[0][:120]
        raise UserError(f"data.path: cannot read '{path}' ({type(e).__name__}: {detail}): check the file's format "
                        "and encoding (UTF-8)") from None
    return list(ds)


def _check_columns(rows: list[dict[str, Any]], cfg: DataConfig) -> None:
    needed = {"text": [cfg.text_field], "instruction": [cfg.prompt_field, cfg.response_field],
              "chat": [cfg.messages_field]}[cfg.format]
    missing = [c for c in needed if c not in rows[0]]
    if missing:
        raise UserError(f"data.format={cfg.format}: column(s) {missing} missing from data.path (found "
                        f"{sorted(rows[0])}): set data.{cfg.format}_field names or pick another data.format")


def build_data(cfg: DataConfig, tok: PreTrainedTokenizerBase, *, seed: int) -> TokenizedData:
    raw = load_raw(cfg, seed)
    if not raw:
        raise UserError(f"data.path: '{cfg.path}' holds no rows: point it at a non-empty dataset")
    _check_columns(raw, cfg)
    order = list(range(len(raw)))
    random.Random(seed).shuffle(order)  # the held-out split is fixed by the seed, not by file order
    num_eval = int(len(raw) * cfg.eval_fraction)
    eval_raw = [raw[i] for i in order[:num_eval]]
    train_raw = [raw[i] for i in order[num_eval:]]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def encode(rows: list[dict[str, Any]]) -> Rows:
        docs = [d for d in (encode_row(r, cfg, tok) for r in rows) if d[0]]
        return pack(docs, cfg.seq_len, pad_id, cfg.packing)

    train, evald = encode(train_raw), encode(eval_raw)
    if len(train) == 0:
        raise UserError(f"data.path: no trainable rows after tokenizing '{cfg.path}' (format={cfg.format})")
    if train.num_truncated:
        warnings.warn(f"{train.num_truncated} documents longer than data.seq_len={cfg.seq_len} were truncated",
                      stacklevel=2)
    if not (train.labels[:, 1:] != -100).any():
        raise UserError(f"data: no target tokens left in '{cfg.path}' (every response was cut off at "
                        f"data.seq_len={cfg.seq_len}?): raise data.seq_len or shorten the prompts")
    return TokenizedData(train=train, eval=evald, eval_raw=eval_raw)
