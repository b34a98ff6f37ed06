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


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Femi", "Greta", "Hiro", "Ines", "Jonas")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")
_INSTRUCTION = ("Solve the math word problem. Reason step by step inside <think> </think>, then give the final "
                "answer as a single number after the closing tag.\n\nQuestion: ")


def _word_problem(rng: random.Random) -> tuple[str, str]:
    """A GSM8K-like two-step word problem behind a reasoning instruction (a GRPO prompt's usual shape); the answer
    a number. Prompts run 300-325 characters: past a 256-token budget under the character tokenizer."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, n, k, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 9)
    question = (f"{name} has {a} {item}. At the market {name} buys {n} boxes with {k} {item} in each box, then gives "
                f"{c} {item} to a friend. How many {item} does {name} have now?")
    return f"{_INSTRUCTION}{question}\nAnswer:", str(a + n * k - c)


def _wrong_reversal(rng: random.Random, s: str) -> str:
    """A plausible mistake: mostly the string copied instead of reversed, else its reversal with one letter
    changed (harder: a 6-character reversal must be right at every position to tell)."""
    r = s[::-1]
    for _ in range(10):
        if rng.random() < 0.75:
            out = s
        else:
            i = rng.randrange(len(r))
            out = r[:i] + rng.choice(ALPHABET.replace(r[i], "")) + r[i + 1 :]
        if out != r:
            return out
    return r[1:] + r[0]  # a rotation of a non-constant string; constant ones are re-drawn by the caller


TASKS = {"reverse": _reverse, "sort": _sort, "add": _add, "word-problem": _word_problem}
PREFERENCE_TASKS = {"prefer-reverse": "reverse"}  # name -> the task whose answer is the chosen response
# GRPO (data.format=prompt): name -> the task whose rows become {prompt, answer}, the answer a column for the
# reward functions (exact_match reads `answer`), never shown to the policy
PROMPT_TASKS = {"prompt-reverse": "reverse", "prompt-word-problem": "word-problem"}


def names() -> list[str]:
    return sorted([*TASKS, *PREFERENCE_TASKS, *PROMPT_TASKS])


def generate(name: str, num_samples: int, seed: int) -> list[dict[str, str]]:
    """Distinct prompts (so eval rows never appear in training), as {prompt, response} rows, for a preference
    task {prompt, chosen, rejected} rows (chosen: the right answer; rejected: a wrong one), for a prompt task
    {prompt, answer} rows."""
    if name in PREFERENCE_TASKS:
        return _preference(name, num_samples, seed)
    if name in PROMPT_TASKS:
        return [{"prompt": r["prompt"], "answer": r["response"]} for r in generate(PROMPT_TASKS[name], num_samples, seed)]
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


def _preference(name: str, num_samples: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(f"{name}-{seed}")
    rows = []
    for row in generate(PREFERENCE_TASKS[name], num_samples, seed):
        s = row["response"][::-1]
        if len(set(s)) == 1:  # "aaa": every wrong answer is a letter change; keep the generator simple: skip it
            continue
        rows.append({"prompt": row["prompt"], "chosen": row["response"], "rejected": _wrong_reversal(rng, s)})
    return rows
