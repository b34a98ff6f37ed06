"""Built-in synthetic instruction tasks with checkable answers (`data.path=builtin:NAME`).

The demo trains on one and measures held-out exact-match accuracy with greedy decoding before and after, so
"it learned" is a number, not a feeling. Generation is seeded: the same seed gives the same rows everywhere.
"""
from __future__ import annotations

import random

ALPHABET = "abcdefgh"


def _reverse(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 6)))
    return f"reverse {s}=", s[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return f"sort {s}=", "".join(sorted(s))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


TASKS = {"reverse": _reverse, "sort": _sort, "add": _add}


def generate(name: str, num_samples: int, seed: int) -> list[dict[str, str]]:
    """Distinct prompts (so eval rows never appear in training), as {prompt, response} rows."""
    if name not in TASKS:
        raise KeyError(name)
    rng = random.Random(f"{name}-{seed}")
    rows: dict[str, str] = {}
    for _ in range(num_samples * 20):
        if len(rows) == num_samples:
            break
        prompt, response = TASKS[name](rng)
        rows.setdefault(prompt, response)
    return [{"prompt": p, "response": r} for p, r in rows.items()]
