"""How many times a run goes over its training data, said in one line when it is more than once: a 50-row
dataset trained for 30 steps of 4 rows sees each row 2.4 times, and a run sized by train.max_steps says nothing else
about it. Torch-free: `shardtune validate` says it too when the data cache already knows the row count."""
from __future__ import annotations


def repeat_notice(*, num_rows: int, steps: int, global_size: int) -> str | None:
    """The line for `steps` optimizer steps of `global_size` rows (DPO: pairs, as the trainer counts them) over
    `num_rows` training rows, or None when the run sees each row at most once."""
    seen = steps * global_size
    if num_rows <= 0 or seen <= num_rows:
        return None
    epochs = f"{seen / num_rows:,.2f}".rstrip("0").rstrip(".")
    return (f"data: {num_rows:,} training rows -> {steps:,} steps x {global_size:,} rows = {epochs} epochs: each row "
            f"is seen {epochs} times on average (train.epochs=N sizes a run in passes over the data instead of "
            "train.max_steps)")
