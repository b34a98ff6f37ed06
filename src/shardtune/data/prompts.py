"""`data.format: prompt` (GRPO) in the cache: each row's prompt tokenized once, its prompt and other columns kept.

A kept row k is document k of the entry's document store (prompt ids, no targets, never packed) and line k of
`prompt_rows.arrow`, one JSON string {"row": source row, "prompt": string or messages, "columns": {...}}: the
prompt as the reward functions receive it and every other column as read (JSON; values JSON cannot hold become
strings). A split's rows are its kept rows in order (`{split}_docs.npy`), so `PromptRows(entry, split, manifest)`
reads prompt k of a split from two memory maps, without loading the dataset.

A prompt longer than data.seq_len keeps its END (the tokens next to where generation starts, as TRL truncates
prompts on the left); such prompts are counted and warned about.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data import docs as store
from shardtune.data.messages import TOOLS_COLUMN
from shardtune.data.prompt_encoding import encode_prompt, ignored_template, prompt_value
from shardtune.data.rows import _ListView, open_documents
from shardtune.data.tokens import IGNORE
from shardtune.errors import UserError

ROWS_FILE = "prompt_rows.arrow"


class PromptBuilder:
    """The prompt builder for build.py's entry writer: a unit is a source row, stored as one unpacked document."""

    def __init__(self, cfg: DataConfig, tok: PreTrainedTokenizerBase) -> None:
        self.cfg, self.tok = cfg, tok
        self.truncated = np.zeros(0, dtype=bool)  # per row
        self.columns: list[str] = []  # the columns kept for the reward functions

    def encode(self, raw: Any, dtype: str, tmp: Path, progress: Callable[[int, int], None] | None) -> store.Documents:
        cfg = self.cfg
        if len(raw) and ignored_template(raw[0][cfg.prompt_field], cfg):
            warnings.warn(ignored_template(raw[0][cfg.prompt_field], cfg), stacklevel=2)
        docs: list[tuple[list[int], list[int]]] = []
        lines, truncated = [], []
        for i in range(len(raw)):
            row = raw[i]
            try:
                ids = encode_prompt(row.get(cfg.prompt_field), cfg, self.tok, row.get(TOOLS_COLUMN))
                prompt = prompt_value(row[cfg.prompt_field], cfg)
            except UserError as e:
                raise UserError(f"data.path: '{cfg.path}' row {i + 1}, column '{cfg.prompt_field}' "
                                f"(data.prompt_field): {e}") from None
            truncated.append(len(ids) > cfg.seq_len)
            ids = ids[-cfg.seq_len :]
            docs.append((ids, [IGNORE] * len(ids)))
            columns = {k: v for k, v in row.items() if k != cfg.prompt_field}
            lines.append(json.dumps({"row": i, "prompt": prompt, "columns": columns}, default=str))
        if progress is not None:
            progress(len(raw), len(raw))
        self.truncated = np.array(truncated, dtype=bool)
        self.columns = sorted({k for i in range(min(len(raw), 1)) for k in raw[i]} - {cfg.prompt_field})
        with pa.OSFile(str(tmp / ROWS_FILE), "wb") as sink:
            table = pa.table({"json": pa.array(lines, type=pa.large_string())})
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        table = pa.concat_tables([store.docs_table(docs[a : a + store.BATCH_ROWS], seq_len=cfg.seq_len, dtype=dtype)
                                  for a in range(0, len(docs), store.BATCH_ROWS)])
        return store.documents([store.write_docs(table, tmp)], table, num_units=len(docs))

    def lay_out(self, docs: store.Documents, units: np.ndarray) -> store.Layout:
        """One prompt per row, in the split's order."""
        stats = {"rows": len(units), "documents": len(units), "prompts": len(units),
                 "tokens": int(np.minimum(docs.length[units], self.cfg.seq_len).sum()), "target_tokens": 0,
                 "truncated": int(self.truncated[units].sum())}
        return store.Layout(units.astype(np.int64), np.arange(len(units) + 1, dtype=np.int64), stats)

    def check(self, stats: dict[str, Any]) -> None:
        cfg, train = self.cfg, stats["train"]
        if train["prompts"] == 0:
            raise UserError(f"data.path: no training prompts left in '{cfg.path}': lower data.eval_fraction")
        cut = train["truncated"] + stats["eval"]["truncated"]
        if cut:
            warnings.warn(f"{cut} prompts longer than data.seq_len={cfg.seq_len} tokens were truncated (each keeps "
                          "its end, next to the completion): raise data.seq_len to keep them whole", stacklevel=2)

    def source_row(self, unit: int) -> int:
        return unit

    def manifest_fields(self) -> dict[str, Any]:
        return {"packing": False, "prompt_rows": ROWS_FILE, "reward_columns": self.columns}


@dataclass(frozen=True)
class PromptRow:
    ids: list[int]  # the prompt's tokens, as the policy continues them (cut to data.seq_len, keeping the end)
    prompt: str | list[dict[str, Any]]  # TRL's `prompts` entry: the string, or the messages
    columns: dict[str, Any]  # every other column of the row, for the reward functions
    source_row: int  # 0-based row of the data (what error lines name, 1-based)


class PromptRows:
    """One split of a prompt entry: `take(indices)` -> PromptRow each, read from the memory-mapped store."""

    def __init__(self, entry: Path, split: str, manifest: dict[str, Any]) -> None:
        assert "prompt_rows" in manifest, f"{entry} is not a data.format=prompt entry"
        self.order = np.load(entry / f"{split}_docs.npy", mmap_mode="r")  # [prompts] kept-row ids, split order
        documents = open_documents(entry, manifest["files"])
        self._ids = [_ListView(c) for c in documents.column("input_ids").chunks]
        self._starts = np.cumsum([0] + [len(c) for c in self._ids])  # first document id of each chunk
        table = pa.ipc.open_stream(pa.memory_map(str(entry / manifest["prompt_rows"]))).read_all()
        self._json = table.column("json")

    def __len__(self) -> int:
        return len(self.order)

    def get(self, i: int) -> PromptRow:
        d = int(self.order[i])
        c = int(np.searchsorted(self._starts, d, side="right")) - 1
        ids = self._ids[c].get(d - int(self._starts[c])).astype(np.int64).tolist()
        row = json.loads(self._json[d].as_py())
        return PromptRow(ids, row["prompt"], row["columns"], row["row"])

    def take(self, idx: Any) -> list[PromptRow]:
        return [self.get(int(i)) for i in np.asarray(idx, dtype=np.int64).reshape(-1)]

