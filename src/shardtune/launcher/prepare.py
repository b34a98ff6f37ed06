"""`shardtune prepare`: build (or find) a recipe's data cache and print what training will see."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers and torch load only once the cheap checks have passed (a refusal takes ~0.3 s)
    from shardtune.data.pipeline import TokenizedData

BAR_WIDTH = 40


def prepare_recipe(recipe_arg: str, overrides: list[str], *, show: int | None = None) -> TokenizedData:
    """Build or find the cache and print its report; `show`: then example N with its trained and masked spans."""
    from shardtune.config.load import load_recipe
    from shardtune.data.check import check_data_head
    from shardtune.launcher.launch import check_run_dirs
    from shardtune.plan.model_limits import check_model_limits

    recipe = load_recipe(recipe_arg, overrides)
    check_run_dirs(recipe)  # the cache goes under data.cache_dir or train.output_dir
    # What validate and train's launcher refuse, refused alike before anything heavy (torch, transformers) loads.
    check_model_limits(recipe)
    check_data_head(recipe.data)
    from shardtune.data.pipeline import build_data
    from shardtune.launcher.validate import build_on_meta
    from shardtune.model.build import build_tokenizer

    build_on_meta(recipe.model)  # no cache built for a model that cannot be built
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
    if show is not None:
        from shardtune.data.show import show_example

        print(show_example(data, tok, show))
    return data


def format_report(data: TokenizedData, *, seconds: float) -> str:
    if data.parts:  # a mix: each dataset's report, then the mix's shares
        total = sum(data.weights)
        reports = [f"dataset {i + 1} of {len(data.parts)} (weight {w:g}, {w / total:.1%} of training rows):\n"
                   + format_report(p, seconds=seconds) for i, (p, w) in enumerate(zip(data.parts, data.weights))]
        return "\n".join(reports + [f"mix: {len(data.train):,} training rows per epoch, eval {len(data.eval):,} rows "
                                    "(every dataset's held-out rows)"])
    m = data.manifest
    train, ev = m["stats"]["train"], m["stats"]["eval"]
    slots = train["rows"] * m["seq_len"]
    verb = f"built in {seconds:.1f} s" if data.built else f"cache hit, {seconds:.1f} s, nothing tokenized"
    lines = [f"cache: {data.entry} ({verb})",
             f"source rows: {m['source_rows']:,} -> train {train['documents']:,} documents in {train['rows']:,} rows "
             f"of {m['seq_len']} (packing={'on' if m['packing'] else 'off'}), eval {ev['documents']:,} documents "
             f"in {ev['rows']:,} rows",
             f"format: {_describe(m.get('data', {}))}",
             f"tokens: {train['tokens']:,} train ({train['target_tokens']:,} with a loss), {ev['tokens']:,} eval; "
             f"stored as {m['token_dtype']}",
             _long_documents(m),
             f"packing efficiency: {_pct(train['target_tokens'], slots)} of train slots are target tokens, "
             f"{_pct(train['tokens'], slots)} hold a token (the rest is padding)",
             "document length (tokens, before truncation):"]
    if "pairs" in train:  # data.format=preference: two documents (chosen, rejected) per pair
        lines.insert(2, f"preference pairs: {train['pairs']:,} train, {ev['pairs']:,} eval; "
                        f"{m.get('identical_pairs', 0):,} dropped (chosen identical to rejected)")
    if "prompts" in train:  # data.format=prompt (GRPO): one prompt per row, no targets (completions are sampled)
        from shardtune.data.build import truncated_counts

        cols = ", ".join(m.get("reward_columns", [])) or "none"
        lines = [lines[0], f"source rows: {m['source_rows']:,} -> prompts: {train['prompts']:,} train, "
                 f"{ev['prompts']:,} eval; columns for the reward functions: {cols}", lines[2],
                 f"tokens: {train['tokens']:,} train, {ev['tokens']:,} eval (prompts, no targets: completions are "
                 f"sampled); stored as {m['token_dtype']}",
                 f"truncated prompts (longer than data.seq_len={m['seq_len']}, each keeps its end): "
                 f"{truncated_counts(m['stats'])}", "prompt length (tokens, as stored):"]
    lines += _histogram(m["histogram"])
    return "\n".join(lines)


def _long_documents(m: dict[str, Any]) -> str:
    from shardtune.data.build import truncated_counts

    train, ev = m["stats"]["train"], m["stats"]["eval"]
    if m.get("long_docs") == "split":
        return (f"split documents (longer than data.seq_len={m['seq_len']}): {train['split'] + ev['split']:,} "
                f"(train {train['split']:,}, eval {ev['split']:,}), into {train['pieces'] + ev['pieces']:,} pieces "
                "in all (data.long_docs=split)")
    return f"truncated documents (longer than data.seq_len={m['seq_len']}): {truncated_counts(m['stats'])}"


def _describe(fields: dict[str, Any]) -> str:
    """'instruction (prompt=instruction, input=input, response=output; template alpaca)': the columns read."""
    from shardtune.data.formats import FORMATS

    if fields.get("format") not in FORMATS:
        return "?"
    fmt = FORMATS[fields["format"]]
    keys = fmt.required + fmt.optional
    if fields["format"] == "chat" and not fields.get("messages_field"):  # TRL's prompt/completion layout
        keys = ("prompt_field", "response_field")
    cols = ", ".join(f"{k.removesuffix('_field')}={fields[k]}" for k in keys if fields.get(k))
    extra = {"instruction": f"; template {fields.get('template')}", "chat": f"; style {fields.get('chat_style')}",
             "preference": f"; template {fields.get('template')} for string prompts"}
    on_inputs = "; loss on inputs too" if fields.get("train_on_inputs") else ""
    return f"{fields['format']} ({cols}{extra.get(fields['format'], '')}{on_inputs})"


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
