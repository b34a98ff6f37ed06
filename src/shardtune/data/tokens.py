"""What every data module shares about token ids: the label that takes no loss, and reading ids back from a
tokenizer call (a list, or a BatchEncoding when transformers returns one)."""
from __future__ import annotations

from typing import Any

IGNORE = -100


def as_ids(x: Any) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    return list(x)
