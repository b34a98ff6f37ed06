"""data.long_docs: truncate (the default) keeps a document's first seq_len tokens; split keeps every token, in
seq_len pieces that continue one another (each piece reads the previous one's last token as context), so every
token but a document's first is a target exactly once, with and without packing. `prepare` counts the split
documents and pieces, and transformers' too-long-sequence warning is not shown (through the installed executable:
tests/integration/test_installed_executable.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.formats import IGNORE

TOK = build_char_tokenizer()
SEQ = 16


def write_docs(path: Path, lengths: list[int]) -> list[list[int]]:
    """One document per line; returns each one's token ids as format=text stores them (BOS + chars + EOS)."""
    lines = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(n)) for i, n in enumerate(lengths)]
    path.write_text("\n".join(lines) + "\n")
    return [[TOK.bos_token_id, *TOK(ln, add_special_tokens=False)["input_ids"], TOK.eos_token_id] for ln in lines]


def segments(ids: np.ndarray, labels: np.ndarray, positions: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """The documents (or pieces) of each row, split where position ids restart; padding left out."""
    out = []
    for row_ids, row_labels, row_pos in zip(ids, labels, positions):
        starts = [*np.flatnonzero(row_pos == 0).tolist(), len(row_pos)]
        for a, b in zip(starts, starts[1:]):
            if (row_labels[a:b] == IGNORE).all() and (row_ids[a:b] == TOK.pad_token_id).all():
                continue  # padding
            out.append((row_ids[a:b].tolist(), row_labels[a:b].tolist()))
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_split_keeps_every_token_once_in_continuing_pieces(tmp_path, packing):
    lengths = [1, 1, 1, 40, 14, 100]  # tokens 3, 3, 3, 42 (3 pieces), 16 (fits exactly), 102 (7 pieces)
    docs = write_docs(tmp_path / "long.txt", lengths)
    cfg = DataConfig(path=str(tmp_path / "long.txt"), format="text", seq_len=SEQ, packing=packing,
                     long_docs="split", eval_fraction=0.0)
    data = build_data(cfg, TOK, seed=0, output_dir=str(tmp_path))
    rows = data.train
    pieces = segments(*rows.take(np.arange(len(rows))))
    rebuilt: list[tuple[list[int], list[int]]] = []  # (tokens, targets) per document, pieces joined
    for toks, labels in pieces:
        assert len(toks) <= SEQ and labels[0] == IGNORE
        targets = [t for t in labels if t != IGNORE]
        if rebuilt and toks[0] != TOK.bos_token_id:  # a continuing piece: it opens with the last one's last token
            assert toks[0] == rebuilt[-1][0][-1]
            rebuilt[-1] = (rebuilt[-1][0] + toks[1:], rebuilt[-1][1] + targets)
        else:
            rebuilt.append((toks, targets))
    assert sorted(rebuilt) == sorted((d, d[1:]) for d in docs)  # every token, each a target once (not the BOS)
    stats = data.manifest["stats"]["train"]
    assert stats["split"] == 2 and stats["pieces"] == 3 + 3 + 1 + 7 and stats["truncated"] == 0
    if packing:  # the short documents and the last pieces share rows; full pieces fill a row alone
        assert len(rows) < stats["pieces"]


def test_truncate_stays_the_default(tmp_path):
    docs = write_docs(tmp_path / "long.txt", [3, 40])
    data = build_data(DataConfig(path=str(tmp_path / "long.txt"), format="text", seq_len=SEQ, eval_fraction=0.0),
                      TOK, seed=0, output_dir=str(tmp_path))
    kept = sorted(toks for toks, _ in segments(*data.train.take(np.arange(len(data.train)))))
    assert kept == sorted(d[:SEQ] for d in docs) and data.manifest["stats"]["train"]["truncated"] == 1

