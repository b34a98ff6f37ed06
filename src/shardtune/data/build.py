"""Raw rows -> one cache entry, written into a temp dir: `build_entry`, the one writer, and the builder per format.

The writer does what every format shares: fix the held-out split from the seed, save each split's layout arrays,
keep some raw held-out rows and return the manifest. The format's builder (BUILDERS) supplies only what differs:
how rows become documents, how a split's documents become rows, what it counts and which errors it raises.

SFT (every format but preference): load the rows with `datasets` (Arrow on disk, never a Python list), tokenize
every row once with `map(batched=True, num_proc=N)` (fast tokenizer, one call per 1,000 rows; builtin tasks, a few
thousand rows in memory, the same batches in-process with pyarrow alone), then lay the documents of each split out
into rows of `seq_len` (`layout_rows`). Tokens are stored as uint16 when the vocabulary fits, else int32 (a quarter
/ half of int64); the loss mask as Arrow booleans (1 bit per token). Labels, position ids and padding are rebuilt
per batch (rows.py), so nothing of size rows x seq_len exists.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import threading
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.docs import (
    BATCH_ROWS,
    EVAL_RAW_KEEP,
    Documents,
    Layout,
    docs_table,
    documents,
    manifest,
    token_dtype,
    write_docs,
)
from shardtune.data.fields import resolve_fields
from shardtune.data.formats import encode_batch
from shardtune.data.preference import PairBuilder
from shardtune.data.prompts import PromptBuilder
from shardtune.errors import UserError

PIECE_ROWS = 100_000  # rows per map() call: the progress bar moves once per piece
PARALLEL_MIN_ROWS = 20_000  # below this a process pool costs more than it saves
MAX_DOC_TOKENS = 2**31 - 1  # data.long_docs=split stores documents whole (Arrow's int32 list offsets)

Progress = Callable[[int, int], None]


class FormatBuilder(Protocol):
    """What a data format supplies to `build_entry`; built per entry from the resolved DataConfig."""

    def encode(self, raw: Any, dtype: str, tmp: Path, progress: Progress | None) -> Documents: ...

    def lay_out(self, docs: Documents, units: np.ndarray) -> Layout: ...  # one split, from its units in order

    def check(self, stats: dict[str, Any]) -> None: ...  # the UserError for an entry with nothing to train on

    def source_row(self, unit: int) -> int: ...  # the raw row a unit came from (held-out rows kept for the demo)

    def manifest_fields(self) -> dict[str, Any]: ...  # `packing` and the format's own manifest keys


def build_entry(raw: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase, tmp: Path, *, seed: int,
                progress: Progress | None = None) -> dict[str, Any]:
    """Tokenize `raw` (a `datasets.Dataset`, or for builtin tasks a list of row dicts) into `tmp`; returns the
    manifest (stats and file names)."""
    n = len(raw)
    if n == 0:
        raise UserError(f"data.path: '{cfg.path}' holds no rows: point it at a non-empty dataset")
    cfg = resolve_fields(cfg, list(raw[0]) if isinstance(raw, list) else raw.column_names)
    builder = builder_for(cfg, tok)
    dtype = token_dtype(tok)
    docs = builder.encode(raw, dtype, tmp, progress)
    order = list(range(docs.num_units))
    random.Random(seed).shuffle(order)  # the held-out split is fixed by the seed, not by file order
    num_eval = int(docs.num_units * cfg.eval_fraction)
    eval_units = np.array(order[:num_eval], dtype=np.int64)
    stats: dict[str, Any] = {}
    for split, units in (("train", np.array(order[num_eval:], dtype=np.int64)), ("eval", eval_units)):
        layout = builder.lay_out(docs, units)
        np.save(tmp / f"{split}_docs.npy", layout.docs)
        np.save(tmp / f"{split}_rows.npy", layout.rows)
        if layout.starts is not None:
            np.save(tmp / f"{split}_starts.npy", layout.starts)
        stats[split] = layout.stats
    builder.check(stats)
    _write_eval_raw(raw, [builder.source_row(u) for u in eval_units[:EVAL_RAW_KEEP].tolist()], tmp)
    files, lengths = docs.files, docs.length
    del docs  # release the Arrow maps before the temp dir is renamed
    shutil.rmtree(tmp / "raw", ignore_errors=True)  # datasets' own Arrow copy of the input files
    return manifest(cfg, tok, files=files, dtype=dtype, source_rows=n, num_eval_raw=num_eval, stats=stats,
                    lengths=lengths, **builder.manifest_fields())


def _write_eval_raw(raw: Any, keep: list[int], tmp: Path) -> None:
    """Held-out source rows as read: the demo decodes their prompts for its exact-match check."""
    with open(tmp / "eval_raw.jsonl", "w") as f:
        for row in ([raw[i] for i in keep] if isinstance(raw, list) else raw.select(keep).to_list()):
            f.write(json.dumps(row, default=str) + "\n")


class SftBuilder:
    """text, instruction, chat: a source row is one document (none for a chat without an assistant turn); a row of
    seq_len holds documents (data.packing) or pieces of a long one (data.long_docs=split)."""

    def __init__(self, cfg: DataConfig, tok: PreTrainedTokenizerBase) -> None:
        self.cfg, self.tok = cfg, tok

    def encode(self, raw: Any, dtype: str, tmp: Path, progress: Progress | None) -> Documents:
        encode = _encode_rows if isinstance(raw, list) else _encode_dataset
        files, table = encode(raw, self.cfg, self.tok, dtype, tmp, progress)
        return documents(files, table, num_units=len(raw))

    def lay_out(self, docs: Documents, units: np.ndarray) -> Layout:
        cfg, length = self.cfg, docs.length  # length: before truncation
        split_docs = cfg.long_docs == "split"
        kept = np.minimum(length, cfg.seq_len)
        ids = units[kept[units] > 0]  # rows with nothing to learn (a chat without an assistant turn) are dropped
        docs_of, starts, sizes = split_pieces(ids, length, cfg.seq_len) if split_docs else (ids, None, kept[ids])
        offsets = layout_rows(sizes, cfg.seq_len, cfg.packing)
        longer = int((length[ids] > cfg.seq_len).sum())
        stats = {"rows": len(offsets) - 1, "documents": len(ids), "tokens": int(sizes.sum()),
                 "target_tokens": int(docs.num_targets[ids].sum()), "truncated": 0 if split_docs else longer}
        if split_docs:
            stats.update(split=longer, pieces=len(docs_of))
        return Layout(docs_of.astype(np.int64 if len(length) >= 2**31 else np.int32), offsets, stats, starts)

    def check(self, stats: dict[str, Any]) -> None:
        cfg, train = self.cfg, stats["train"]
        if train["rows"] == 0:
            why = " (no row has an assistant turn)" if cfg.format == "chat" else ""
            raise UserError(f"data.path: no trainable rows after tokenizing '{cfg.path}' (format={cfg.format}){why}: "
                            "check data.format and the field keys (`shardtune validate` shows the rows it reads)")
        if train["target_tokens"] == 0:
            warn_truncated(stats, cfg.seq_len)
            raise UserError(f"data: no target tokens left in '{cfg.path}' (every response was cut off at "
                            f"data.seq_len={cfg.seq_len}?): raise data.seq_len or shorten the prompts")

    def source_row(self, unit: int) -> int:
        return unit

    def manifest_fields(self) -> dict[str, Any]:
        return {"packing": self.cfg.packing, "long_docs": self.cfg.long_docs}


# Preference rows become pairs of documents, prompt rows one prompt each (data/prompts.py), never packed; every other
# format's rows are SFT documents.
BUILDERS: dict[str, type[FormatBuilder]] = {"preference": PairBuilder, "prompt": PromptBuilder}


def builder_for(cfg: DataConfig, tok: PreTrainedTokenizerBase) -> FormatBuilder:
    return BUILDERS.get(cfg.format, SftBuilder)(cfg, tok)


def _encode_dataset(raw: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase, dtype: str, tmp: Path,
                    progress: Progress | None) -> tuple[list[str], pa.Table]:
    """Files of any size: `datasets.map`, in pieces of PIECE_ROWS rows, over a process pool when large enough.
    Each piece's output is an Arrow IPC stream file in `tmp` (what rows.py maps)."""
    import datasets

    n = len(raw)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype)),
                                  "target": datasets.Sequence(datasets.Value("bool")),
                                  "length": datasets.Value("int32"), "num_targets": datasets.Value("int32")})
    num_proc = cfg.num_proc or min(os.cpu_count() or 1, 8)
    files: list[str] = []
    pieces = []
    with interrupt_between_pieces() as interrupted:
        for start in range(0, n, PIECE_ROWS):
            interrupted.check()
            _encode_piece(raw, start, n, num_proc, cfg, tok, dtype, tmp, features, files, pieces)
            if progress is not None:
                progress(min(n, start + PIECE_ROWS), n)
        interrupted.check()
    return files, datasets.concatenate_datasets(pieces).data.table


def _encode_piece(raw: Any, start: int, n: int, num_proc: int, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                  dtype: str, tmp: Path, features: Any, files: list[str], pieces: list[Any]) -> None:
    """Rows [start, start + PIECE_ROWS): one `map`; its file names go to `files`, its dataset to `pieces`."""
    piece = raw.select(range(start, min(n, start + PIECE_ROWS)))  # contiguous: a slice, no index mapping
    # num_proc=None, not 1: datasets 5 starts a one-process pool for num_proc=1 (a fork per piece)
    procs = num_proc if len(piece) >= PARALLEL_MIN_ROWS and num_proc > 1 else None
    out = piece.map(_encode_for_cache, batched=True, batch_size=BATCH_ROWS, num_proc=procs,
                    fn_kwargs={"cfg": cfg, "tok": tok, "dtype": dtype}, remove_columns=raw.column_names, features=features,
                    cache_file_name=str(tmp / f"docs-{start // PIECE_ROWS:05d}.arrow"),
                    new_fingerprint=hashlib.sha1(f"{tmp.name}-{start}".encode()).hexdigest(), load_from_cache_file=False)
    files += [Path(f["filename"]).name for f in out.cache_files]
    pieces.append(out)


class _Interrupt:
    def __init__(self) -> None:
        self.requested = False

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


@contextmanager
def interrupt_between_pieces():
    """Ctrl-C during a `map` over a process pool: the default handler's KeyboardInterrupt is lost inside
    datasets' pool loop (the build ran to the end, exit 0), and the forked workers, which inherit the handler,
    would print a traceback each. So a handler only records it, and the build stops at the next piece boundary
    (a few seconds at most), where the caller's cleanup removes the temp folder and the CLI exits 130."""
    state = _Interrupt()
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield state
        return
    previous = signal.signal(signal.SIGINT, lambda *_: setattr(state, "requested", True))
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


def _encode_rows(raw: list[dict[str, Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase, dtype: str, tmp: Path,
                 progress: Progress | None) -> tuple[list[str], pa.Table]:
    """Rows in memory (builtin tasks: thousands): the same batches as `_encode_dataset`, in this process, written
    with pyarrow into one IPC stream file of the same schema, importing neither `datasets` nor pandas."""
    tables = [_encode_for_cache({k: [r[k] for r in raw[start : start + BATCH_ROWS]] for k in raw[0]}, cfg=cfg,
                                tok=tok, dtype=dtype) for start in range(0, len(raw), BATCH_ROWS)]
    docs = pa.concat_tables(tables)
    name = write_docs(docs, tmp)
    if progress is not None:
        progress(len(raw), len(raw))
    return [name], docs


def layout_rows(lengths: np.ndarray, seq_len: int, packing: bool) -> np.ndarray:
    """Row r holds documents [offsets[r], offsets[r+1]) of the split's document order. Packing is greedy and
    never splits a document: one that does not fit in the current row's space starts the next row."""
    if not packing or len(lengths) == 0:
        return np.arange(len(lengths) + 1, dtype=np.int64)
    starts = [0]
    used = 0
    for i, n in enumerate(lengths.tolist()):  # sequential by nature; ~0.3 s per million documents
        if used and used + n > seq_len:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def split_pieces(ids: np.ndarray, length: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """data.long_docs=split: each document as pieces of at most seq_len tokens, in order. Piece k starts at token
    k * (seq_len - 1): its first token is the previous piece's last, read as context (its label is masked, as every
    row-start's is) so that every token but the document's first is a target exactly once, as when the document
    fits. Returns (document id, first token, length) per piece."""
    n = length[ids]
    stride = seq_len - 1
    count = np.where(n <= seq_len, 1, -(-(n - 1) // stride))  # pieces: ceil((n - 1) / stride) for long ones
    docs_of = np.repeat(ids, count)
    first = np.repeat(np.cumsum(count) - count, count)  # index of each document's first piece
    starts = (np.arange(len(docs_of)) - first) * stride
    sizes = np.minimum(np.repeat(n, count) - starts, seq_len)
    return docs_of, starts.astype(np.int64), sizes


def truncated_counts(stats: dict[str, Any]) -> str:
    """"76 (train 70, eval 6)": the same words in `prepare`'s report and in the warning."""
    train, ev = stats["train"]["truncated"], stats["eval"]["truncated"]
    return f"{train + ev:,} (train {train:,}, eval {ev:,})"


def warn_truncated(stats: dict[str, Any], seq_len: int) -> None:
    if stats["train"]["truncated"] + stats["eval"]["truncated"]:
        warnings.warn(f"{truncated_counts(stats)} documents longer than data.seq_len={seq_len} were truncated",
                      stacklevel=3)


def _encode_for_cache(batch: dict[str, list[Any]], *, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                      dtype: str) -> Any:
    """One batch of rows -> an Arrow table, built from flat numpy arrays (a Python list per row would cost more
    than the tokenizer). Labels are the ids or IGNORE, so a boolean `target` stores them; the first token of a
    document is never a target (no prediction across a packing boundary). Documents are cut to seq_len here."""
    keep = cfg.seq_len if cfg.long_docs == "truncate" else MAX_DOC_TOKENS  # split: whole documents (rows.py cuts)
    return docs_table(encode_batch(batch, cfg, tok), seq_len=keep, dtype=dtype)


