"""`shardtune prepare --show N`: example N as the cache stores it (what training reads), its trained and masked
spans told apart in plain text (the output may be piped: no colours), with token counts.

Example N is row N of data.path, counting from 0 (a mix: its datasets' rows one after another), or for preference
data the N-th pair kept. Masked tokens (no loss: prompts, user turns, a document's first token) are printed between
MASK_OPEN and MASK_CLOSE, trained ones as they are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from shardtune.data.pipeline import TokenizedData

from shardtune.errors import UserError

MASK_OPEN, MASK_CLOSE = "«", "»"  # rare in data (brackets are not: JSON, code, tool calls)


def show_example(data: TokenizedData, tok: PreTrainedTokenizerBase, n: int) -> str:
    parts = data.parts or [data]
    counts = [_num_examples(p) for p in parts]
    if not 0 <= n < sum(counts):
        raise UserError(f"prepare --show {n}: the data has {sum(counts):,} examples: give one of 0 to "
                        f"{sum(counts) - 1:,}")
    k = 0
    while n >= sum(counts[: k + 1]):
        k += 1
    part, i = parts[k], n - sum(counts[:k])
    where = f"dataset {k + 1} of {len(parts)}, " if len(parts) > 1 else ""
    m = part.manifest
    if "pairs" in m["stats"]["train"]:
        head = (f"example {n}: {where}pair {i} of the {counts[k]:,} kept (counting from 0; "
                f"{m.get('identical_pairs', 0):,} dropped: chosen identical to rejected), {_split(part, 2 * i)}")
        return "\n".join([head, *_document(part, tok, 2 * i, "chosen"), *_document(part, tok, 2 * i + 1, "rejected")])
    head = f"example {n}: {where}row {i} of {counts[k]:,} (counting from 0), {_split(part, i)}"
    if "prompts" in m["stats"]["train"]:  # data.format=prompt: the prompt as generation continues it, the columns
        rows = pa.ipc.open_stream(pa.memory_map(str(Path(part.entry) / m["prompt_rows"]))).read_all()
        columns = json.loads(rows.column("json")[i].as_py())["columns"]
        return "\n".join([head, *_document(part, tok, i, "prompt"),
                          f"columns for the reward functions: {json.dumps(columns, ensure_ascii=False)}"])
    return "\n".join([head, *_document(part, tok, i, "document")])


def _documents(part: TokenizedData) -> pa.Table:
    """Every column of the entry's documents, `length` (before truncation) included (rows.py maps two of them)."""
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(Path(part.entry) / f))).read_all()
                             for f in part.manifest["files"]])


def _num_examples(part: TokenizedData) -> int:
    docs = part.train.documents.num_rows
    return docs // 2 if "pairs" in part.manifest["stats"]["train"] else docs


def _split(part: TokenizedData, doc: int) -> str:
    held_out = np.load(Path(part.entry) / "eval_docs.npy", mmap_mode="r")
    return "held out for eval" if bool((held_out == doc).any()) else "in the train split"


def _document(part: TokenizedData, tok: PreTrainedTokenizerBase, doc: int, name: str) -> list[str]:
    row: dict[str, Any] = _documents(part).slice(doc, 1).to_pylist()[0]
    ids, target, length = row["input_ids"], row["target"], row["length"]
    seq_len = part.manifest["seq_len"]
    if not ids:
        return [f"{name}: no tokens to train on (e.g. a chat without an assistant turn): training leaves it out"]
    trained = sum(target)
    lines = [f"{name}: {len(ids):,} tokens: {trained:,} trained, {len(ids) - trained:,} masked (no loss, between "
             f"{MASK_OPEN} {MASK_CLOSE})"]
    if length > len(ids):  # cut to seq_len when the cache was built (data.long_docs=truncate, preference pairs)
        lines[0] += f"; {length - len(ids):,} more tokens past data.seq_len={seq_len} were cut off"
    elif length > seq_len:  # data.long_docs=split: stored whole, read in pieces
        lines[0] += f"; longer than data.seq_len={seq_len}: trained in pieces (data.long_docs=split)"
    text, spans = [], []
    for start, end, is_target in _spans(target):
        piece = tok.decode(ids[start:end], skip_special_tokens=False)
        text.append(piece if is_target else f"{MASK_OPEN}{piece}{MASK_CLOSE}")
        spans.append(f"{'trained' if is_target else 'masked'} {start}-{end - 1} ({end - start})")
    return [*lines, "".join(text), f"spans (token positions): {', '.join(spans)}"]


def _spans(target: list[bool]) -> list[tuple[int, int, bool]]:
    """Runs of equal target flags as (start, end, flag)."""
    out, start = [], 0
    for i in range(1, len(target) + 1):
        if i == len(target) or target[i] != target[start]:
            out.append((start, i, bool(target[start])))
            start = i
    return out
