"""`shardtune keys [PREFIX]`: every recipe key with its type, default and meaning, read from the schema itself.

The meaning is the comment beside the field in config/schema.py (or the comment block just above it), so the list
cannot drift from the dataclasses: a new key shows up here the moment it is declared.
"""
from __future__ import annotations

import inspect
import io
import re
import tokenize
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import Any

from omegaconf import OmegaConf

from shardtune.config.schema import Recipe
from shardtune.errors import UserError


@dataclass(frozen=True)
class KeyInfo:
    key: str
    type: str
    default: str
    meaning: str


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the trailing one on its line with its continuation lines (comment lines below it
    whose text is indented: `#   more`), else the block of comment lines just above."""
    src = inspect.getsource(cls)
    lines = src.splitlines()
    comments: dict[int, str] = {}  # line number -> the comment's raw text after '#'
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:]
    out = {}
    for i, line in enumerate(lines, 1):
        m = re.match(r"\s{4}(\w+)\s*:", line)
        if not m or line.lstrip().startswith("#"):
            continue
        if i in comments:
            text = [comments[i].strip()]
            j = i + 1
            while j <= len(lines) and lines[j - 1].lstrip().startswith("#") and _continues(comments.get(j, "")):
                text.append(comments[j].strip())
                j += 1
            out[m.group(1)] = " ".join(text)
            continue
        block = []
        j = i - 1
        while j >= 1 and lines[j - 1].lstrip().startswith("#") and not _continues(comments.get(j, "")):
            block.insert(0, comments.get(j, "").strip())
            j -= 1
        if block:
            out[m.group(1)] = " ".join(block)
    return out


def _continues(comment: str) -> bool:
    """A comment line that continues the trailing comment above it: its text starts after more than one space."""
    return comment.startswith("  ")


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return OmegaConf.to_yaml({"v": value}).strip().removeprefix("v:").strip()  # null, true, 1.0e-08 as YAML has them


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=\.) (?=[A-Z])", text, maxsplit=1)[0]


def schema_keys(cls: type = Recipe, prefix: str = "") -> list[KeyInfo]:
    """Every leaf key of the schema, in declaration order (sections are walked, not listed)."""
    notes = _comments(cls)
    out = []
    for f in fields(cls):
        default = _default(f)
        if is_dataclass(default):
            out.extend(schema_keys(type(default), f"{prefix}{f.name}."))
            continue
        out.append(KeyInfo(f"{prefix}{f.name}", str(f.type), _show(default), _first_sentence(notes.get(f.name, ""))))
    return out


def format_keys(prefix: str | None = None) -> str:
    keys = schema_keys()
    if prefix:  # a section (train), a key (train.lr) or the start of key names (launch.threads, train.eval_)
        keys = [k for k in keys if k.key.startswith(prefix)]
        if not keys:
            sections = sorted({k.key.split(".")[0] for k in schema_keys()})
            raise UserError(f"keys: no recipe key starts with '{prefix}': try one of the sections {sections}")
    kw = max(len(k.key) for k in keys)
    tw = max(len(k.type) for k in keys)
    dw = min(max(len(k.default) for k in keys), 24)
    return "\n".join(f"{k.key:<{kw}}  {k.type:<{tw}}  {k.default:<{dw}}  {k.meaning}".rstrip() for k in keys)
