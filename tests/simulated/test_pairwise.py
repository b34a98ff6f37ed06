"""The all-pairs generator behind the settings matrix (pairwise.py): every pair covered by an accepted row, a
refused pair reported instead of run, and the array the same on every run."""
from __future__ import annotations

import itertools

from tests.simulated.pairwise import all_pairs

FACTORS = {"a": [1, 2, 3], "b": ["x", "y"], "c": ["p", "q"], "d": [0, 1, 2, 3]}


def _covered(rows):
    return {(n, r[n], m, r[m]) for r in rows for n, m in itertools.combinations(FACTORS, 2)}


def test_every_pair_is_covered_in_few_rows():
    rows, refused = all_pairs(FACTORS)
    want = {(n, v, m, w) for n, m in itertools.combinations(FACTORS, 2) for v in FACTORS[n] for w in FACTORS[m]}
    assert _covered(rows) == want and not refused
    assert 12 <= len(rows) <= 16  # 3 x 4 = 12 is the least any array can have
    assert rows == all_pairs(FACTORS)[0]  # seeded: the same rows every run


def test_a_refused_pair_is_reported_and_never_run():
    def refuse(row):
        return "a=3 with b=y is refused" if (row["a"], row["b"]) == (3, "y") else None

    rows, refused = all_pairs(FACTORS, refuse)
    assert not any((r["a"], r["b"]) == (3, "y") for r in rows)
    assert [(r["a"], r["b"]) for r, _ in refused] == [(3, "y")] and refused[0][1] == "a=3 with b=y is refused"
    others = {(n, v, m, w) for n, m in itertools.combinations(FACTORS, 2) for v in FACTORS[n] for w in FACTORS[m]}
    assert others - _covered(rows) == {("a", 3, "b", "y")}


def test_each_distinct_row_is_asked_once():
    # the settings matrix's refusal loads a recipe (~50 ms): a probe asked again in every round whose candidates are
    # all refused tripled its collection time once a third objective brought more refused pairs
    asked = []

    def refuse(row):
        asked.append(tuple(row.values()))
        return "d=3, or a=3 with b=y" if row["d"] == 3 or (row["a"], row["b"]) == (3, "y") else None

    rows, refused = all_pairs(FACTORS, refuse, tries=8)
    assert refused and len(asked) == len(set(asked))


def test_an_excluded_pair_is_a_constraint_not_a_loss_of_coverage():
    # d=0 runs only with c=q (as offloaded activations need checkpointing): probed with c at its first value, every
    # pair of d=0 would read as refused; excluded, only (c=p, d=0) is, and d=0 meets every other value
    def refuse(row):
        return "d=0 needs c=q" if (row["c"], row["d"]) == ("p", 0) else None

    want = {(n, v, m, w) for n, m in itertools.combinations(FACTORS, 2) for v in FACTORS[n] for w in FACTORS[m]}
    rows, refused = all_pairs(FACTORS, refuse, excluded=[("c", "p", "d", 0)])
    assert want - _covered(rows) == {("c", "p", "d", 0)} and not any(refuse(r) for r in rows)
    assert [((r["c"], r["d"]), why) for r, why in refused] == [(("p", 0), "d=0 needs c=q")]
    without = all_pairs(FACTORS, refuse)[0]  # the probe's first values: d=0's other pairs are lost with it
    assert len(want - _covered(without)) > 1
