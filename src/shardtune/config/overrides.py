"""Command-line overrides, `KEY=VALUE`: one rule for every command that takes a recipe (validate, plan, prepare,
train, slurm).

- KEY is a dotted recipe key (`train.lr`, `data.path[0].weight`).
- VALUE is read as YAML, as in a recipe file: `train.lr=1e-4`, `lora.target_modules=[q_proj,k_proj]`,
  `model.path=null`, and an empty VALUE is null.
- A key whose schema type is a string (`data.template`, `model.chat_template`, `train.output_dir`, ...) takes the
  text itself, because a template is exactly what YAML cannot read unquoted (`{prompt}` is a mapping,
  `Q: {prompt}` a mapping, a Jinja `{% ... %}` a syntax error). The escapes `\\n`, `\\t` and `\\\\` are decoded, so
  `data.template="Q: {prompt}\\nA: "` in a shell is a two-line template. A value in quotes is a YAML string
  (`'data.template="x"'`: x); `null` and `~` are null; a YAML list stays a list (the key's check then says a list
  is not a string, rather than taking `[a,b]` as a column's name).
- Any other key whose VALUE YAML cannot read takes the text too; its type check then names the key.
"""
from __future__ import annotations

import functools
import re
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardtune.config.schema import Recipe
from shardtune.errors import UserError

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
# PyYAML's safe loader on libyaml when the wheel has it (the same resolver and constructor, ~10x faster per value).
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_ESCAPE = re.compile(r"\\([nt\\])")


def parse_overrides(overrides: list[str]) -> DictConfig:
    """The overrides as one config to merge over the recipe."""
    out = OmegaConf.create({})
    for o in overrides:
        key, sep, text = o.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"override '{o}' is not KEY=VALUE: write e.g. train.lr=1e-4")
        value = override_value(key, text)
        check_section_value(key, value, f"override {o}")
        try:
            OmegaConf.update(out, key, value, merge=True)
        except OmegaConfBaseException as e:
            raise UserError(f"override '{o}': {str(e).splitlines()[0]}: write KEY=VALUE, e.g. train.lr=1e-4") from None
    return out


def override_value(key: str, text: str) -> Any:
    """VALUE as the recipe gets it (the rule in the module docstring)."""
    if text.strip() in ("", "null", "~"):
        return None
    try:
        value = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError:
        value = text
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    if is_string_key(key) and not quoted and not isinstance(value, list):
        return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], text)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The schema dataclass's fields and their types (typing.get_type_hints resolves every annotation anew on each
    call: ~0.7 ms, paid per override key per load before this cache)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def is_string_key(key: str) -> bool:
    """True when the schema types `key` as a string (optional or not)."""
    cls: Any = Recipe
    hint: Any = None
    for part in key.split("."):
        if not is_dataclass(cls) or part not in _hints(cls):
            return False
        hint = _hints(cls)[part]
        cls = hint
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return str in args and all(a in (str, type(None)) for a in args)


def section_class(key: str) -> type | None:
    """The schema dataclass when `key` names a section (lora, train, ...), else None."""
    cls: Any = Recipe
    for part in key.split("."):
        if not is_dataclass(cls) or part not in _hints(cls):
            return None
        cls = _hints(cls)[part]
    return cls if is_dataclass(cls) else None


def check_section_value(key: str, value: Any, source: str) -> None:
    """A section given a value instead of its keys (`lora=true`; OmegaConf's own error names neither the key nor
    the fix): one line naming the key to set, `lora.enabled=true` when the section has that switch."""
    cls = section_class(key)
    if cls is None or isinstance(value, dict):
        return
    switch = "enabled" in _hints(cls) and isinstance(value, bool)
    if source.startswith("override"):
        fix = f"{key}.enabled={str(value).lower()}" if switch else f"{key}.KEY=VALUE"
    else:
        fix = f"{key}: {{enabled: {str(value).lower()}}}" if switch else f"{key}: {{KEY: VALUE}}"
    raise UserError(f"{source}: '{key}' is a section of keys, not a value: write {fix} (`shardtune keys {key}` "
                    "lists its keys)")
