"""A greedy all-pairs covering array: rows over named factors such that every pair of values of every two factors
appears together in at least one accepted row (AETG-style: each new row starts from a pair not yet covered and
fills the other factors one at a time with the value that covers the most uncovered pairs; of `tries` such
candidates the one covering most is kept; ties broken by a seeded shuffle, so the array is the same every run).

`refused(row)` names why the product refuses a row (None when it runs); it is asked only of the candidates about
to be kept (it may be slow), once per distinct row. A refused row covers nothing; when every candidate is refused, a
seed pair the product refuses with every other factor at its first value is dropped from what must be covered and
reported, so the caller can assert the refusal instead of running it.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Row = dict[str, Any]


def _pairs(row: Row, names: Sequence[str]) -> set[tuple]:
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}


def all_pairs(factors: Mapping[str, Sequence[Any]], refused: Callable[[Row], str | None] = lambda row: None,
              *, seed: int = 0, tries: int = 8, cost: Callable[[str, Any], float] = lambda name, value: 0.0,
              ) -> tuple[list[Row], list[tuple[Row, str]]]:
    """-> (rows that run, covering every pair not refused; [(row, reason)] for each refused pair). `cost(name,
    value)`: what a value adds to a row's cost (ranks started, say); among equally covering choices the cheaper wins."""
    names = list(factors)
    rng = random.Random(seed)
    answers: dict[tuple, str | None] = {}

    def ask(row: Row) -> str | None:  # once per distinct row: a probe recurs in every round whose candidates all fail
        key = tuple(row[n] for n in names)
        if key not in answers:
            answers[key] = refused(row)
        return answers[key]

    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}
    refusals: list[tuple[Row, str]] = []
    rows: list[Row] = []
    while uncovered:
        seeds = [_seed(uncovered, rng) for _ in range(tries)]
        candidates = sorted(((len(_pairs(row, names) & uncovered), sum(cost(n, v) for n, v in row.items()), i, row)
                             for i, row in enumerate(_candidate(factors, names, seed, uncovered, rng, cost)
                                                     for seed in seeds)),
                            key=lambda c: (-c[0], c[1], c[2]))
        best = next((row for *_, row in candidates if ask(row) is None), None)  # asked lazily: it costs
        if best is not None:
            rows.append(best)
            uncovered -= _pairs(best, names)
            continue
        for a, va, b, vb in set(seeds):  # every candidate refused: is its seed pair refused on its own?
            probe = {n: factors[n][0] for n in names} | {a: va, b: vb}
            reason = ask(probe)
            if reason is not None and (a, va, b, vb) in uncovered:
                uncovered.discard((a, va, b, vb))
                refusals.append((probe, reason))
    return rows, refusals


def _seed(uncovered: set[tuple], rng: random.Random) -> tuple:
    return rng.choice(sorted(uncovered, key=repr))


def _candidate(factors: Mapping[str, Sequence[Any]], names: list[str], seed: tuple, uncovered: set[tuple],
               rng: random.Random, cost: Callable[[str, Any], float]) -> Row:
    a, va, b, vb = seed
    row: Row = {a: va, b: vb}
    rest = [n for n in names if n not in row]
    rng.shuffle(rest)
    for n in rest:
        values = list(factors[n])
        rng.shuffle(values)
        row[n] = max(values, key=lambda v: (sum((m, row[m], n, v) in uncovered or (n, v, m, row[m]) in uncovered
                                                for m in row), -cost(n, v)))
    return {n: row[n] for n in names}
