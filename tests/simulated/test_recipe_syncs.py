"""Every recipes/hardware recipe's training step has one host synchronization on the simulated GPU (its read of the
loss and the norm, which carries the ranks' stop agreement too; a GRPO recipe's sampling reads apart, bounded
below), with the product's defaults and the recipe's own
settings, the Qwen3-30B-A3B MoE recipes included: the simulated GPU takes CUDA's branches (the MoE routing and NF4
experts have no simulated-only path), so a sync in them is counted. The recipes run with 2 decoder
layers (model.config pointed at a copy of theirs): the syncs of a step do not depend on its depth (asserted once at
2 and 3 layers), and 2 layers keep each recipe a few seconds. The 128k recipe runs at 16,384 tokens for the same
reason: its loops over the sequence (4 MLP chunks, hundreds of packed documents' attention calls) run the same code
at any length, and 131,072 tokens of short documents took ~60 s of loop turns. Two steps: the first copies its own batch and runs
DPO's start-of-training eval, the second finds its batch prefetched."""
from __future__ import annotations

from pathlib import Path

import pytest

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.plan.planner import world_of
from shardtune.plan.simulate import _simulated_world
from shardtune.trainer.decode import STOP_EVERY
from tests.simulated.shallow import shallow_config
from tests.simulated.test_step_syncs import stop_request

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes" / "hardware").glob("*.yaml"))
STEP_READ = ("to_host", "shardtune.trainer.train:train_step")


def _step_syncs(name: str, tmp: Path, *, layers: int) -> list[list[tuple[str, str]]]:
    from shardtune.trainer.train import setup, train_step

    base = load_recipe(name)
    world, nodes = world_of(base)
    with _simulated_world(world, nodes), stop_request() as stop:
        seq = ["data.seq_len=16384"] if base.data.seq_len > 16384 else []
        recipe = load_recipe(name, [shallow_config(name, layers, tmp), "train.grad_accum=2",
                                    f"train.output_dir={tmp / 'run'}", *seq])
        run = setup(recipe, simulated=True)
        run.model.train()
        steps = []
        for step in range(2):
            accelerator.TRACE.clear()
            train_step(run, step, None, stop)
            steps.append(accelerator.host_syncs())
        return steps


# GRPO's sampling (trainer/decode.py) reads the device: the early stop's ended counts once every decode.STOP_EVERY
# forwards, transformers' SDPA mask check (`padding_mask.all()`) every decoding forward; and once per sampling batch,
# the completions for the rewards. Not the training step's: counted apart.
EARLY_STOP = ("to_host", "shardtune.trainer.decode:_first_all_ended")
MASK_READ = ("item", "transformers.masking_utils:_ignore_causal_mask_sdpa")
DECODE_READS = {EARLY_STOP, MASK_READ}
SAMPLE_READ = ("to_host", "shardtune.trainer.sampling:_sample_batch")


@pytest.mark.parametrize("name", RECIPES)
def test_hardware_recipe_step_has_one_host_sync(name: str, tmp_path: Path) -> None:
    assert any(n.startswith("qwen3-30b-a3b-qlora") for n in RECIPES)  # MoE + NF4 experts among them
    steps = _step_syncs(name, tmp_path, layers=2)
    recipe = load_recipe(name)
    if recipe.train.objective == "grpo":
        tokens = recipe.grpo.max_new_tokens  # the simulated reads never say "ended": every batch decodes them all
        batches = [step.count(SAMPLE_READ) for step in steps]
        early = [step.count(EARLY_STOP) for step in steps]
        masks = [step.count(MASK_READ) for step in steps]
        # a batch: at most one early-stop read per STOP_EVERY tokens; a mask read per forward (the prompt's, each token's)
        assert batches[1] == 2 and all(e <= -(-tokens // STOP_EVERY) * n and m <= (tokens + 1) * n
                                       for e, m, n in zip(early, masks, batches)), (batches, early, masks)
        steps = [[s for s in step if s not in DECODE_READS and s != SAMPLE_READ] for step in steps]
    assert steps == [[STEP_READ], [STEP_READ]]


def test_host_syncs_do_not_depend_on_depth(tmp_path: Path) -> None:
    """What makes 2 layers stand for the recipe's 80: per layer, no sync (the test above would count each)."""
    name = "llama-3.1-70b-qlora-2x24gb-offload"  # offload, NF4, checkpointing: the most per-layer machinery
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _step_syncs(name, tmp_path / "a", layers=2) == _step_syncs(name, tmp_path / "b", layers=3)
