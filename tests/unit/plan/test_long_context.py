"""plan --fit searches the long-context knobs (plan/long_context.py): at a sequence only they make fit, every
candidate it returns uses them, and its overrides name them so `train --fit` applies them."""
from __future__ import annotations

from shardtune.plan import make_plan
from shardtune.plan.search import fit_search

RECIPE = "llama-3.1-8b-lora-1x24gb"  # fits up to ~10k tokens as shipped (bench/RESULTS.md)


def test_fit_finds_offloading_and_the_chunked_mlp_at_40k_tokens():
    plan = make_plan(RECIPE, ["data.seq_len=40960"])
    assert not plan.fits
    found = fit_search(plan)
    assert found
    for c in found:
        s = c.plan.setup
        assert c.plan.fits and s.checkpointing is not False and s.offload_activations
        assert "engine.offload_activations=true" in c.overrides()
        if s.mlp_chunk:
            assert f"engine.mlp_chunk_tokens={s.mlp_chunk}" in c.overrides()
