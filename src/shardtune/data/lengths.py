"""`validate`'s sample of token lengths: how many of the rows it tokenized data.seq_len would cut, and how many of
those lose trained tokens (a final answer after a long tool output trains on nothing), said before `prepare`
tokenizes the whole file. Rows as `check.py` samples them: the head of each file, fields resolved."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.pair_encoding import Encoded, encode_pair, truncate_pair
from shardtune.data.tokens import IGNORE


def long_rows_warning(cfg: DataConfig, rows: list[dict[str, Any]], encoded: Encoded, tok: PreTrainedTokenizerBase,
                      where: str) -> str | None:
    """One line when some sampled rows are longer than data.seq_len and would be truncated; None otherwise (and
    for data.long_docs=split, which keeps every token). `encoded`: the rows as the format encodes them, uncut."""
    s = cfg.seq_len
    if cfg.format == "preference":  # encoded pairs are cut already: measure them before truncate_pair
        lengths, lost = [], 0
        for row in rows:
            p, c, r = encode_pair(row, cfg, tok)
            lengths.append(len(p) + max(len(c), len(r)))
            _, tc, tr, _ = truncate_pair(p, c, r, s)
            lost += len(tc) < len(c) or len(tr) < len(r)
        cut = f"a pair keeps its prompt's end and its responses' first {s} tokens in all"
        fix = "raise data.seq_len"
    elif cfg.format == "prompt":  # no targets: a long prompt loses its start (data/prompts.py)
        long = [len(ids) for ids, _ in encoded if len(ids) > s]
        return (f"data.path {where}: {len(long)} of the first {len(rows)} prompts are longer than data.seq_len={s} "
                f"tokens (longest {max(long):,}); each would keep only its last {s} tokens: raise data.seq_len "
                "(`shardtune prepare` counts every row)") if long else None
    else:
        if cfg.long_docs == "split":
            return None
        lengths = [len(ids) for ids, _ in encoded]
        lost = sum(any(label != IGNORE for label in labels[s:]) for _, labels in encoded)
        cut = f"data.long_docs=truncate keeps a row's first {s} tokens"
        fix = "raise data.seq_len, or set data.long_docs=split to train on every token in pieces"
    long = [n for n in lengths if n > s]
    if not long:
        return None
    return (f"data.path {where}: {len(long)} of the first {len(rows)} rows are longer than data.seq_len={s} tokens "
            f"(longest {max(long):,}); {lost} of them have trained tokens past it (e.g. a final answer) that would "
            f"not be trained on ({cut}): {fix} (`shardtune prepare` counts every row)")
