"""A greedy all-pairs covering array: rows over named factors such that every pair of values of every two factors
appears together in at least one accepted row (AETG-style: each new row starts from a pair not yet covered and
fills the other factors one at a time with the value that covers the most uncovered pairs; of `tries` such
candidates the one covering most is kept; ties broken by a seeded shuffle, so the array is the same every run).

`refused(row)` names why the product refuses a row (None when it runs); it is asked only of the candidates about
to be kept (it may be slow), once per distinct row. A refused row covers nothing; when every candidate is refused, a
seed pair the product refuses with every other factor at its first value (one making no excluded pair) is dropped
from what must be covered and reported, so the caller can assert the refusal instead of running it.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

Row = dict[str, Any]


def _pairs(row: Row, names: Sequence[str]) -> set[tuple]:
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}


def all_pairs(factors: Mapping[str, Sequence[Any]], refused: Callable[[Row], str | None] = lambda row: None,
              *, seed: int = 0, tries: int = 8, cost: Callable[[str, Any], float] = lambda name, value: 0.0,
              excluded: Collection[tuple[str, Any, str, Any]] = ()) -> tuple[list[Row], list[tuple[Row, str]]]:
    """-> (rows that run, covering every pair not refused; [(row, reason)] for each refused pair). `cost(name,
    value)`: what a value adds to a row's cost (ranks started, say); among equally covering choices the cheaper wins.
    `excluded`: pairs (name, value, name, value) the caller expects the product to refuse, as a constraint (PICT's):
    each is asked up front (every other factor at its first value); refused, it is reported and no candidate holds it,
    so a value that needs another factor's value (offloaded activations need checkpointing) is still paired with
    every other value; accepted, it is covered as any pair."""
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
    avoid: set[tuple] = set()
    for a, va, b, vb in excluded:
        probe = _probe(factors, names, (a, va, b, vb), avoid=set())
        reason = ask(probe)
        if reason is not None:
            uncovered -= {(a, va, b, vb), (b, vb, a, va)}
            avoid |= {(a, va, b, vb), (b, vb, a, va)}
            refusals.append((probe, reason))
    rows: list[Row] = []
    while uncovered:
        seeds = [_seed(uncovered, rng) for _ in range(tries)]
        candidates = sorted(((len(_pairs(row, names) & uncovered), sum(cost(n, v) for n, v in row.items()), i, row)
                             for i, row in enumerate(_candidate(factors, names, seed, uncovered, avoid, rng, cost)
                                                     for seed in seeds)),
                            key=lambda c: (-c[0], c[1], c[2]))
        best = next((row for *_, row in candidates if ask(row) is None), None)  # asked lazily: it costs
        if best is not None:
            rows.append(best)
            uncovered -= _pairs(best, names)
            continue
        for a, va, b, vb in set(seeds):  # every candidate refused: is its seed pair refused on its own?
            probe = _probe(factors, names, (a, va, b, vb), avoid)
            reason = ask(probe)
            if reason is not None and (a, va, b, vb) in uncovered:
                uncovered.discard((a, va, b, vb))
                refusals.append((probe, reason))
    return rows, refusals


def _probe(factors: Mapping[str, Sequence[Any]], names: list[str], pair: tuple, avoid: set[tuple]) -> Row:
    """The pair, every other factor at its first value that makes no excluded pair with those set before it."""
    a, va, b, vb = pair
    row: Row = {a: va, b: vb}
    for n in names:
        if n not in row:
            row[n] = next((v for v in factors[n] if not any((m, row[m], n, v) in avoid for m in row)), factors[n][0])
    return {n: row[n] for n in names}


def _seed(uncovered: set[tuple], rng: random.Random) -> tuple:
    return rng.choice(sorted(uncovered, key=repr))


def _candidate(factors: Mapping[str, Sequence[Any]], names: list[str], seed: tuple, uncovered: set[tuple],
               avoid: set[tuple], rng: random.Random, cost: Callable[[str, Any], float]) -> Row:
    a, va, b, vb = seed
    row: Row = {a: va, b: vb}
    rest = [n for n in names if n not in row]
    rng.shuffle(rest)
    for n in rest:
        values = list(factors[n])
        rng.shuffle(values)
        row[n] = max(values, key=lambda v: (not any((m, row[m], n, v) in avoid for m in row),
                                            sum((m, row[m], n, v) in uncovered or (n, v, m, row[m]) in uncovered
                                                for m in row), -cost(n, v)))
    return {n: row[n] for n in names}
