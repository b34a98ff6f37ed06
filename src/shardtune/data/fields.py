"""Which columns a dataset's format reads: the data.* field keys, checked against the columns the data has.

A field left at its default that the data lacks is looked up among the names the common public formats use
(Alpaca's instruction/output, ShareGPT's conversations), so those files train without any mapping; a field set
explicitly is used as given. A missing column is one error naming the data.* keys that map it.
"""
from __future__ import annotations

from dataclasses import fields as dataclass_fields
from dataclasses import replace

from shardtune.config.schema import DataConfig
from shardtune.data.formats import FORMATS
from shardtune.errors import UserError

# data.* key -> the other column names tried, in order, when the key is at its default and its column is absent
ALIASES = {"prompt_field": ("instruction", "question", "query"), "response_field": ("output", "answer", "completion"),
           "messages_field": ("conversations",), "text_field": ("content",)}
_DEFAULTS = {f.name: f.default for f in dataclass_fields(DataConfig)}


def resolve_fields(cfg: DataConfig, columns: list[str], *, where: str | None = None) -> DataConfig:
    """`cfg` with each field key of its format naming an existing column; `input_field` is emptied when that
    optional column is absent. Raises UserError naming the keys to set."""
    fmt = FORMATS[cfg.format]
    where = where or f"data.path '{cfg.path}'"
    found: dict[str, str] = {}
    missing = []
    for key in fmt.required + fmt.optional:
        name = getattr(cfg, key)
        if name in columns:
            continue
        alias = next((a for a in ALIASES.get(key, ()) if a in columns), None) if name == _DEFAULTS[key] else None
        if alias is not None:
            found[key] = alias
        elif key in fmt.required:
            missing.append(key)
        elif name != _DEFAULTS[key]:  # an optional column the user named explicitly must exist
            missing.append(key)
        else:
            found[key] = ""
    missing = _trl_layouts(cfg, missing, columns, found)
    if missing:
        raise UserError(missing_columns_message(cfg, missing, columns, where))
    return replace(cfg, **found) if found else cfg


def _trl_layouts(cfg: DataConfig, missing: list[str], columns: list[str], found: dict[str, str]) -> list[str]:
    """TRL's two layouts without the usual column, marked by an empty field key (formats.py reads them):
    chat rows {prompt: [messages], completion: [messages]} (messages_field ""), and preference rows whose chosen and
    rejected are whole conversations with no prompt column (prompt_field "": their shared opening is the prompt)."""
    if cfg.format == "chat" and missing == ["messages_field"] and cfg.messages_field == _DEFAULTS["messages_field"]:
        response = next((c for c in (cfg.response_field, "completion") if c in columns), None)
        if cfg.prompt_field in columns and response is not None:
            found.update(messages_field="", response_field=response)
            return []
    if cfg.format == "preference" and missing == ["prompt_field"] and cfg.prompt_field == _DEFAULTS["prompt_field"]:
        found["prompt_field"] = ""
        return []
    return missing


def missing_columns_message(cfg: DataConfig, missing: list[str], columns: list[str], where: str) -> str:
    fmt = FORMATS[cfg.format]
    named = ("columns " if len(missing) > 1 else "column ") + " and ".join(f"'{getattr(cfg, k)}' (data.{k})"
                                                                        for k in missing)
    keys = " and ".join(f"data.{k}=COLUMN" for k in fmt.required + fmt.optional if k in missing or k in fmt.required)
    others = "; ".join(f"{name}: {', '.join('data.' + k for k in f.required)}" for name, f in FORMATS.items()
                       if name != cfg.format)
    return (f"data.format={cfg.format}: {named} missing from {where} (columns: {', '.join(sorted(columns)) or 'none'}): "
            f"set {keys}, or another data.format ({others})")
