"""`data.format: preference`: rows {prompt, chosen, rejected} -> pairs of documents in the same Arrow cache.

Each value is a string, or a chat message list (the prompt a list of messages, chosen and rejected the assistant
turn(s) that follow it, rendered with the tokenizer's chat template). Pair p is stored as documents 2p (prompt +
chosen) and 2p + 1 (prompt + rejected), never packed: a split's rows are its pairs' documents in order, so row 2k is
the chosen and row 2k + 1 the rejected of the split's k-th pair. Prompt tokens are masked (IGNORE).

Truncation keeps what DPO compares. When prompt + the longer response exceed seq_len, the prompt keeps its END
(the tokens next to the answer) and at least min(len(prompt), seq_len // 2) of them; both responses keep their
START, cut to the same budget seq_len - kept prompt, so the two documents of a pair share one prompt.
Pairs whose chosen equals their rejected teach nothing (their log-ratio difference is 0): they are dropped,
counted in the manifest and warned about.
"""
from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.batches import GlobalBatches, MicroBatch
from shardtune.data.build import (
    BATCH_ROWS,
    EVAL_RAW_KEEP,
    docs_table,
    int_column,
    length_histogram,
    token_dtype,
    write_docs,
)
from shardtune.data.formats import IGNORE, _as_ids
from shardtune.data.sources import ENTRY_KEYS
from shardtune.errors import UserError


def truncate_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int
                  ) -> tuple[list[int], list[int], list[int], bool]:
    """See the module docstring. Returns (prompt, chosen, rejected, truncated)."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return prompt, chosen, rejected, False
    keep = max(seq_len - longest, min(len(prompt), seq_len // 2))
    budget = seq_len - keep
    return prompt[len(prompt) - keep :], chosen[:budget], rejected[:budget], True


def split_shared_prompt(chosen: Any, rejected: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """TRL's implicit prompt: chosen and rejected are two conversations; the turns they open with in common are
    the prompt, the rest of each its response (as trl.extract_prompt splits them)."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UserError("data.format=preference: rows without a prompt column need chosen and rejected as "
                        "conversations (message lists) sharing their opening turns: add a prompt column "
                        "(data.prompt_field) for text values")
    shared = next((i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), min(len(chosen), len(rejected)))
    if shared == 0:
        raise UserError("data.format=preference: a row's chosen and rejected conversations share no opening turn, "
                        "so no prompt can be taken from them: add a prompt column (data.prompt_field)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _text_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_pair(row: dict[str, Any], cfg: DataConfig, tok: PreTrainedTokenizerBase
                ) -> tuple[list[int], list[int], list[int]]:
    """One row -> (prompt ids, chosen ids, rejected ids), untruncated."""
    chosen, rejected = row[cfg.chosen_field], row[cfg.rejected_field]
    prompt = row[cfg.prompt_field] if cfg.prompt_field else None
    if not cfg.prompt_field:
        prompt, chosen, rejected = split_shared_prompt(chosen, rejected)
    if isinstance(prompt, list):  # chat: the responses are the assistant turn(s) after the prompt's messages
        if not tok.chat_template:
            raise UserError("data.format=preference: message-list rows need a tokenizer with a chat template: "
                            "use string values or another tokenizer")
        before = _as_ids(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        out = [before]
        for resp in (chosen, rejected):
            turns = resp if isinstance(resp, list) else [{"role": "assistant", "content": str(resp)}]
            full = _as_ids(tok.apply_chat_template(prompt + turns, tokenize=True))
            if full[: len(before)] != before:
                raise UserError("data.format=preference: the chat template does not render the response after "
                                "the prompt as a prefix: use string values for this tokenizer")
            out.append(full[len(before):])
        return out[0], out[1], out[2]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return bos + _text_ids(tok, str(prompt)), _text_ids(tok, str(chosen)) + eos, _text_ids(tok, str(rejected)) + eos


@dataclass
class _Encoded:
    docs: list[tuple[list[int], list[int]]]  # 2 per kept pair: chosen, rejected
    kept: list[int]  # source row of each kept pair
    identical: int
    truncated: list[bool]  # per kept pair


def _encode(raw: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase) -> _Encoded:
    out = _Encoded([], [], 0, [])
    for i in range(len(raw)):
        row = raw[i]
        for key in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field):
            if key and row.get(key) is None:
                raise UserError(f"data.path: row {i} has no '{key}': every preference row needs "
                                f"{cfg.prompt_field}, {cfg.chosen_field} and {cfg.rejected_field} (set data.*_field "
                                "to remap column names)")
        if row[cfg.chosen_field] == row[cfg.rejected_field]:
            out.identical += 1
            continue
        p, c, r, cut = truncate_pair(*encode_pair(row, cfg, tok), cfg.seq_len)
        if c == r:  # different texts, the same tokens once cut to data.seq_len: nothing to prefer
            out.identical += 1
            continue
        for resp in (c, r):
            out.docs.append((p + resp, [IGNORE] * len(p) + resp))
        out.kept.append(i)
        out.truncated.append(cut)
    return out


def build_pair_entry(raw: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase, tmp: Path, *, seed: int,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The preference twin of build.build_entry: same files and manifest keys, plus `pairs` counts."""
    from shardtune.data.fields import resolve_fields

    cfg = resolve_fields(cfg, list(raw[0]) if isinstance(raw, list) else raw.column_names)
    dtype = token_dtype(tok)
    enc = _encode(raw, cfg, tok)
    if progress is not None:
        progress(len(raw), len(raw))
    if enc.identical:
        warnings.warn(f"data: {enc.identical} preference rows have chosen identical to rejected (as written, or "
                      f"once truncated to data.seq_len={cfg.seq_len}); they were dropped", stacklevel=2)
    n = len(enc.kept)
    if n == 0:
        raise UserError(f"data.path: no usable preference pairs in '{cfg.path}' (every row's chosen equals its "
                        "rejected?)")
    tables = [docs_table(enc.docs[a : a + BATCH_ROWS], seq_len=cfg.seq_len, dtype=dtype)
              for a in range(0, len(enc.docs), BATCH_ROWS)]
    import pyarrow as pa

    docs = pa.concat_tables(tables)
    files = [write_docs(docs, tmp)]
    order = list(range(n))
    random.Random(seed).shuffle(order)
    num_eval = int(n * cfg.eval_fraction)
    lengths = int_column(docs, "length")  # the documents are cut to seq_len already
    targets = int_column(docs, "num_targets")
    stats: dict[str, Any] = {}
    for split, pairs in (("train", order[num_eval:]), ("eval", order[:num_eval])):
        pairs_arr = np.array(pairs, dtype=np.int64)
        ids = np.stack([2 * pairs_arr, 2 * pairs_arr + 1], axis=1).reshape(-1)
        np.save(tmp / f"{split}_docs.npy", ids)
        np.save(tmp / f"{split}_rows.npy", np.arange(len(ids) + 1, dtype=np.int64))
        stats[split] = {"rows": len(ids), "documents": len(ids), "pairs": len(pairs),
                        "tokens": int(lengths[ids].sum()), "target_tokens": int(targets[ids].sum()),
                        "truncated": int(sum(enc.truncated[p] for p in pairs))}
    if stats["train"]["pairs"] == 0:
        raise UserError(f"data.path: no training pairs left in '{cfg.path}': lower data.eval_fraction")
    if stats["train"]["truncated"]:
        warnings.warn(f"{stats['train']['truncated']} preference pairs longer than data.seq_len={cfg.seq_len} were "
                      "truncated (prompt keeps its end, responses their start)", stacklevel=2)
    with open(tmp / "eval_raw.jsonl", "w") as f:
        for p in order[:num_eval][:EVAL_RAW_KEEP]:
            f.write(json.dumps(raw[enc.kept[p]], default=str) + "\n")
    return {"files": files, "token_dtype": dtype, "seq_len": cfg.seq_len, "packing": False,
            "pad_id": tok.pad_token_id if tok.pad_token_id is not None else 0, "source_rows": len(raw),
            "num_eval_raw": num_eval, "identical_pairs": enc.identical, "stats": stats,
            "histogram": length_histogram(lengths, cfg.seq_len),
            "data": {k: getattr(cfg, k) for k in ENTRY_KEYS}}  # the fields read (prepare's report)


@dataclass
class PairMicroBatch(MicroBatch):
    """2b rows: the b chosen documents, then the b rejected ones, in the same pair order."""

    pair_ids: np.ndarray  # [b] int64, indices of the pairs in their split (reference log-prob lookup)


class PairRows:
    """A split's rows seen as pairs: take(pairs) -> the chosen rows, then the rejected rows."""

    def __init__(self, rows: Any) -> None:
        assert len(rows) % 2 == 0, "a preference split holds two rows per pair"
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) // 2

    def take(self, idx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        return self.rows.take(np.concatenate([2 * idx, 2 * idx + 1]))

    def micro_batch(self, idx: Any) -> PairMicroBatch:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        return PairMicroBatch(*(torch.from_numpy(x) for x in self.take(idx)), pair_ids=idx)


class PairBatches(GlobalBatches):
    """GlobalBatches over pairs: the same world-size-free order (step k = pairs [kG, (k+1)G) of the seeded
    permutation), a micro-batch is b whole pairs (2b rows), and the loss is normalised by the G pairs of the
    global batch. Each rank reads only its own pairs."""

    def __init__(self, rows: Any, **kwargs: Any) -> None:
        super().__init__(PairRows(rows), **kwargs)

    def step(self, step: int, rank: int) -> tuple[list[MicroBatch], int]:
        idx = self.indices(step)
        micro: list[MicroBatch] = []
        for a in range(self.accum):
            lo = (a * self.world + rank) * self.b
            micro.append(self.rows.micro_batch(idx[lo : lo + self.b]))
        return micro, self.global_size
