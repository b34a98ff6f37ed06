"""Schema checks of the per-dataset data keys, for `data.*` and each entry of a `data.path` list (see
data/sources.py for what a list means). They live with the schema, which runs them; data/ reads ENTRY_KEYS."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FORMATS = ("text", "instruction", "chat", "preference", "prompt")
CHAT_STYLES = ("auto", "openai", "sharegpt")
# Keys an entry of a data.path list may set (besides path and weight): what describes one dataset.
ENTRY_KEYS = ("format", "text_field", "prompt_field", "input_field", "response_field", "template", "messages_field",
              "chat_style", "train_on_inputs", "chosen_field", "rejected_field", "split", "subset")


def _fail(key: str, msg: str) -> None:
    raise ValueError(f"{key}: {msg}")


def check_data_config(data: Mapping[str, Any]) -> None:
    """Schema checks of the per-dataset keys (ValueError "key: message"), for data.* and each list entry. `data`:
    the data section's values by key (the schema passes its DataConfig's fields; this module stays below it)."""
    defaults = {k: data[k] for k in ENTRY_KEYS}
    _check_dataset(defaults, "data.")
    path = data["path"]
    if isinstance(path, (list, tuple)):
        if not path:
            _fail("data.path", "an empty list: give a file, or a list of {path, weight} entries")
        for i, entry in enumerate(path):
            prefix = f"data.path[{i}]"
            if isinstance(entry, dict) and entry.get("format", data["format"]) == "preference":
                _fail(f"{prefix}.format", "preference pairs come from one dataset, not a mix (a mix interleaves "
                      "rows, a pair is two): give data.path one file")
            if isinstance(entry, dict) and entry.get("format", data["format"]) == "prompt":
                _fail(f"{prefix}.format", "GRPO prompts come from one dataset, not a mix (their reward columns "
                      "differ per dataset): give data.path one file")
            if not isinstance(entry, dict) or "path" not in entry:
                _fail(prefix, f"must be a mapping with a path, e.g. {{path: data.jsonl, weight: 1}}, got {entry!r}")
            unknown = sorted(set(entry) - {"path", "weight", *ENTRY_KEYS})
            if unknown:
                _fail(f"{prefix}.{unknown[0]}", f"not a per-dataset key: use path, weight or {', '.join(ENTRY_KEYS)}")
            weight = entry.get("weight", 1)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
                _fail(f"{prefix}.weight", f"must be a number > 0, got {weight!r}")
            _check_dataset({**defaults, **{k: v for k, v in entry.items() if k in ENTRY_KEYS}}, f"{prefix}.")
    elif path is not None and not isinstance(path, str):
        _fail("data.path", f"must be a path or a list of {{path, weight}} entries, got {path!r}")


def _check_dataset(values: dict[str, Any], prefix: str) -> None:
    from shardtune.templates import check_prompt_template

    if values["format"] not in FORMATS:
        _fail(f"{prefix}format", f"must be {', '.join(FORMATS[:-1])} or {FORMATS[-1]}, got {values['format']!r}")
    if values["chat_style"] not in CHAT_STYLES:
        _fail(f"{prefix}chat_style", f"must be auto, openai or sharegpt, got {values['chat_style']!r}")
    for key in ("text_field", "prompt_field", "input_field", "response_field", "messages_field", "template",
                "chosen_field", "rejected_field"):
        # "": no such column (input_field: no input; TRL's layouts, fields.py: messages_field for prompt/completion
        # chats, prompt_field for preference pairs whose shared opening is the prompt)
        if not isinstance(values[key], str) or not (values[key] or key in ("input_field", "messages_field",
                                                                             "prompt_field")):
            _fail(f"{prefix}{key}", f"must be a non-empty string, got {values[key]!r}")
    problem = check_prompt_template(values["template"])
    if problem:
        _fail(f"{prefix}template", problem)
    if not isinstance(values["train_on_inputs"], bool):
        _fail(f"{prefix}train_on_inputs", f"must be true or false, got {values['train_on_inputs']!r}")
