"""`validate`'s data checks: the head of every data file, read, mapped and tokenized as training will.

Sample-based: each file costs one read of at most sample.SAMPLE_BYTES and the tokenization of TOKENIZE_ROWS rows,
whatever its size; their token lengths warn when data.seq_len would cut rows (lengths.py). Returns problems as
lines ("file line N, column 'x': what: fix"); an empty list means the sample looks trainable. What a sample cannot
see (a bad line deep in a file) `prepare` still reports by line.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: the launcher's data pre-flight reads files without transformers (~2 s)
    from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.fields import resolve_fields
from shardtune.data.formats import FORMATS, IGNORE, encode_batch
from shardtune.data.hub_data import pick_split
from shardtune.data.lengths import long_rows_warning
from shardtune.data.messages import to_messages
from shardtune.data.pair_encoding import ignored_template
from shardtune.data.prompt_encoding import ignored_template as ignored_prompt_template
from shardtune.data.prompt_encoding import prompt_problem
from shardtune.data.sample import SAMPLE_ROWS, Sample, data_files, is_saved_dataset, read_sample
from shardtune.data.sources import is_mix, sources
from shardtune.errors import UserError

TOKENIZE_ROWS = SAMPLE_ROWS  # rows tokenized per file: the whole head read (their lengths say what seq_len cuts)
MAX_ROW_PROBLEMS = 3  # per file: the first few name the pattern; hundreds would bury it


def data_problems(cfg: DataConfig, tok: PreTrainedTokenizerBase) -> list[str]:
    problems: list[str] = []
    for i, (src, _) in enumerate(sources(cfg)):
        label = f"data.path[{i}]" if is_mix(cfg) else "data.path"
        try:
            samples = _samples(src)
        except UserError as e:
            problems.append(str(e).replace("data.path", label, 1))
            continue
        for sample in samples:
            problems += [p.replace("data.path", label, 1) for p in _sample_problems(src, sample, tok)]
    return problems


def check_data_head(cfg: DataConfig) -> None:
    """`train`'s launcher, before any worker starts: the head of every data file read and mapped as `validate`
    reads it (encoding, JSON, empty files, missing or non-text fields), without the tokenizer (no transformers
    import: a few ms per file). The first problem is the UserError; tokenizing is left to the workers."""
    for i, (src, _) in enumerate(sources(cfg)):
        label = f"data.path[{i}]" if is_mix(cfg) else "data.path"
        if is_saved_dataset(Path(str(src.path))):
            continue  # `datasets` would be imported to read it: the workers check it
        for sample in _samples(src):
            problems = _head_problems(src, sample)
            if problems:
                raise UserError(problems[0].replace("data.path", label, 1))


def _head_problems(cfg: DataConfig, sample: Sample) -> list[str]:
    where = f"'{sample.file}'"
    if not sample.rows:
        return [f"data.path: {where} has no rows in its first part: check the file's format"]
    try:
        cfg = resolve_fields(cfg, sample.columns, where=f"data.path {where}")
    except UserError as e:
        return [str(e)]
    return _row_problems(cfg, sample, where)


def _samples(cfg: DataConfig) -> list[Sample]:
    path = str(cfg.path)
    if path.startswith("builtin:"):
        from shardtune import synthetic

        rows = synthetic.generate(path.split(":", 1)[1], min(cfg.num_samples, TOKENIZE_ROWS), 0)
        return [Sample(Path(path), list(rows[0]), [(i + 1, r) for i, r in enumerate(rows)], "row")]
    if is_saved_dataset(Path(path)):
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = pick_split(ds, cfg.split, f"the saved dataset '{path}'")
        if len(ds) == 0:
            raise UserError(f"data.path: '{path}' holds no rows: point it at a non-empty dataset")
        head = ds.select(range(min(len(ds), TOKENIZE_ROWS))).to_list()
        return [Sample(Path(path), list(ds.column_names), [(i + 1, r) for i, r in enumerate(head)], "row")]
    out, problems = [], []
    for f in data_files(Path(path)):
        try:
            out.append(read_sample(f))
        except UserError as e:
            problems.append(str(e))
    if problems:
        raise UserError("\n".join(problems))
    return out


def first_row(cfg: DataConfig) -> dict[str, Any] | None:
    """The first row of the first dataset of `data.path` (a file, a folder, a saved dataset or a Hub id; None for
    a builtin:*): what a run's saved prompt style is read from."""
    src = sources(cfg)[0][0]
    path = str(src.path)
    if path.startswith("builtin:"):
        return None
    sample = _samples(src)[0] if is_saved_dataset(Path(path)) else read_sample(data_files(Path(path))[0], limit=1)
    return sample.rows[0][1] if sample.rows else None


def reward_columns(cfg: DataConfig) -> list[str]:
    """data.format=prompt: the columns the reward functions receive, read from the head of the first file (every
    column but the prompt's, as data/prompts.py keeps them): what `validate` checks grpo.reward_funcs against."""
    sample = _samples(sources(cfg)[0][0])[0]
    prompt = resolve_fields(cfg, sample.columns, where=f"data.path '{sample.file}'").prompt_field
    return sorted(c for c in sample.columns if c != prompt)


def _sample_problems(cfg: DataConfig, sample: Sample, tok: PreTrainedTokenizerBase) -> list[str]:
    where = f"'{sample.file}'"
    problems = _head_problems(cfg, sample)
    if problems:
        return problems
    cfg = resolve_fields(cfg, sample.columns, where=f"data.path {where}")
    rows = [r for _, r in sample.rows[:TOKENIZE_ROWS]]
    batch = {c: [r.get(c) for r in rows] for c in sample.columns}
    try:
        # preference pairs come back cut to seq_len; every other format's rows whole (the cache cuts them)
        encoded = encode_batch(batch, cfg, tok)
        long_rows = long_rows_warning(cfg, rows, encoded, tok, where)
    except UserError as e:
        return [f"data.path: {where}: {e}"]
    # prompts have no targets: generation writes the completions
    trained = any(any(lab != IGNORE for lab in labels[1 : cfg.seq_len]) for _, labels in encoded)
    if cfg.format != "prompt" and not trained:
        return [f"data.path: {where}: none of the first {len(rows)} rows has a target token within "
                f"data.seq_len={cfg.seq_len} (prompts too long, or no response/assistant turn): raise data.seq_len "
                "or check the fields"]
    for warning in (long_rows, cfg.format == "preference" and rows and ignored_template(rows[0], cfg),
                    cfg.format == "prompt" and rows and ignored_prompt_template(rows[0].get(cfg.prompt_field), cfg)):
        if warning:
            warnings.warn(warning, stacklevel=2)
    return []


def _row_problems(cfg: DataConfig, sample: Sample, where: str) -> list[str]:
    """Values the format cannot use (a missing or non-text field, a chat that is not a list of turns): one line per
    distinct problem, at its first row, with how many sampled rows share it."""
    fmt = FORMATS[cfg.format]
    first: dict[tuple[str, str], int] = {}
    count: dict[tuple[str, str], int] = {}
    for n, row in sample.rows:
        for key in fmt.required:
            if not getattr(cfg, key):  # a TRL layout without this column (fields.py)
                continue
            bad = _bad_value(cfg, key, row.get(getattr(cfg, key)))
            if bad:
                first.setdefault((key, bad), n)
                count[(key, bad)] = count.get((key, bad), 0) + 1
    out = []
    for (key, bad), n in list(first.items())[:MAX_ROW_PROBLEMS]:
        more = count[(key, bad)] - 1
        also = f" (and {more} more of the first {len(sample.rows)} {sample.unit}s)" if more else ""
        out.append(f"data.path: {where} {sample.unit} {n}, column '{getattr(cfg, key)}' (data.{key}){also}: {bad}")
    return out


def _bad_value(cfg: DataConfig, key: str, value: Any) -> str | None:
    if key == "messages_field":
        try:
            to_messages(value, cfg.chat_style)
        except UserError as e:
            return str(e).removeprefix("data.format=chat: ")
        return None
    if cfg.format == "prompt":  # a string, or messages rendered by the chat template
        return prompt_problem(value, cfg)
    if value is None:
        return "missing or null: every row needs it"
    if isinstance(value, list) and cfg.format == "preference":  # a chat message list: rendered by the template
        return None
    if isinstance(value, (dict, list)):
        return f"holds a {type(value).__name__}, expected text: map data.{key} to a text column"
    return None
