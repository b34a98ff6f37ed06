"""How a trained model expects its prompts: a chat (its chat template), an instruction template, or plain text.

`generate` and `chat` ask the model in the shape it was trained on. A run's recipe says it (data.format, and for
preference data whether the rows are conversations); a folder exported away from its run directory carries the
answer in STYLE_FILE, written by `shardtune export`. A folder with neither (a model from elsewhere) is asked through
its own chat template when its tokenizer has one, else as plain text.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardtune.config.schema import Recipe

STYLE_FILE = "shardtune_prompt.json"
KINDS = ("chat", "instruction", "text")


@dataclass(frozen=True)
class PromptStyle:
    kind: str  # chat | instruction | text
    template: str | None = None  # instruction: data.template (a bundled name or a string with {prompt})

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


def data_setting(recipe: Recipe, key: str) -> Any:
    """A data setting of the run; a mix uses its first dataset's (each part may set its own)."""
    path = recipe.data.path
    if isinstance(path, (list, tuple)) and path and isinstance(path[0], dict) and key in path[0]:
        return path[0][key]
    return getattr(recipe.data, key)


def style_of_recipe(recipe: Recipe) -> PromptStyle:
    fmt = data_setting(recipe, "format")
    if fmt == "chat" or (fmt in ("preference", "prompt") and _conversational_pairs(recipe)):
        return PromptStyle("chat")
    if fmt in ("instruction", "preference", "prompt"):  # string preference/GRPO prompts: data.template too
        return PromptStyle("instruction", data_setting(recipe, "template"))
    return PromptStyle("text")


def _conversational_pairs(recipe: Recipe) -> bool:
    """Preference rows whose prompt or responses are message lists were rendered with the chat template. Read from
    the first row of the data (still where the run read it: the run's own folder usually holds it)."""
    from shardtune.data.check import first_row
    from shardtune.errors import UserError

    try:
        row = first_row(recipe.data)
    except (UserError, OSError):  # the data moved away: the run's chat template, when it has one, decides
        return False
    if row is None:
        return False
    keys = [data_setting(recipe, k) for k in ("prompt_field", "chosen_field", "rejected_field")]
    return any(isinstance(row.get(k), list) for k in keys)


def write_style(folder: Path, style: PromptStyle) -> None:
    (folder / STYLE_FILE).write_text(json.dumps(asdict(style)) + "\n")


def read_style(folder: Path) -> PromptStyle | None:
    f = folder / STYLE_FILE
    if not f.is_file():
        return None
    try:
        values = json.loads(f.read_text())
        return PromptStyle(str(values["kind"]), values.get("template"))
    except (ValueError, KeyError, TypeError, AssertionError):
        from shardtune.errors import UserError

        raise UserError(f"'{f}' is not a shardtune prompt record: delete it (the folder's chat template, if any, "
                        "is then used)") from None


def folder_style(folder: Path, has_chat_template: bool) -> PromptStyle:
    """A folder without a run: its record, else its tokenizer's chat template, else plain text."""
    return read_style(folder) or PromptStyle("chat" if has_chat_template else "text")
