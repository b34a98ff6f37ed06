"""`shardtune prepare`: build (or find) a recipe's data cache and print what training will see."""
from __future__ import annotations

import sys
import time
from typing import Any

from shardtune.data.pipeline import TokenizedData, build_data

BAR_WIDTH = 40


def prepare_recipe(recipe_arg: str, overrides: list[str]) -> TokenizedData:
    from shardtune.config.load import load_recipe
    from shardtune.model import build_tokenizer

    recipe = load_recipe(recipe_arg, overrides)
    tok = build_tokenizer(recipe.model)
    t0 = time.perf_counter()
    if sys.stderr.isatty():  # a bar on a terminal; nothing in a batch log (one line per piece would be noise)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=True) as bar:
            task = bar.add_task("rows", total=None)
            data = build_data(recipe.data, tok, seed=recipe.train.seed, output_dir=recipe.train.output_dir,
                              progress=lambda done, total: bar.update(task, completed=done, total=total))
    else:
        data = build_data(recipe.data, tok, seed=recipe.train.seed, output_dir=recipe.train.output_dir)
    print(format_report(data, seconds=time.perf_counter() - t0))
    return data


def format_report(data: TokenizedData, *, seconds: float) -> str:
    m = data.manifest
    train, ev = m["stats"]["train"], m["stats"]["eval"]
    slots = train["rows"] * m["seq_len"]
    verb = f"built in {seconds:.1f} s" if data.built else f"cache hit, {seconds:.1f} s, nothing tokenized"
    lines = [f"cache: {data.entry} ({verb})",
             f"source rows: {m['source_rows']:,} -> train {train['documents']:,} documents in {train['rows']:,} rows "
             f"of {m['seq_len']} (packing={'on' if m['packing'] else 'off'}), eval {ev['documents']:,} documents "
             f"in {ev['rows']:,} rows",
             f"tokens: {train['tokens']:,} train ({train['target_tokens']:,} with a loss), {ev['tokens']:,} eval; "
             f"stored as {m['token_dtype']}",
             f"truncated documents (longer than data.seq_len={m['seq_len']}): {train['truncated'] + ev['truncated']:,}",
             f"packing efficiency: {_pct(train['target_tokens'], slots)} of train slots are target tokens, "
             f"{_pct(train['tokens'], slots)} hold a token (the rest is padding)",
             "document length (tokens, before truncation):"]
    lines += _histogram(m["histogram"])
    return "\n".join(lines)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f} %" if b else "n/a"


def _histogram(h: dict[str, Any]) -> list[str]:
    edges, counts = h["edges"], h["counts"]
    top = max(counts) or 1
    out = []
    for lo, hi, c in zip(edges, edges[1:], counts):
        label = f"{lo}-{hi - 1}" if hi != edges[-1] else f">= {lo}"
        out.append(f"  {label:>12} {'#' * round(BAR_WIDTH * c / top):<{BAR_WIDTH}} {c:,}")
    return out
