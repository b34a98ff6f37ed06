"""`shardtune plan RECIPE --simulate` (issue 20), through the CLI's `main` forked from the preloaded server
(tests/integration/runs.py `forked_cli`): one real training step on the simulated GPU; its measured peak must agree with the analytic plan within 5 % (bench/RESULTS.md has the table for
every bundled GPU recipe).
  - a bundled GPU recipe at full size: Llama-3.1-8B, LoRA, bf16, checkpointing, seq 2048, one GPU (the other
    bundled recipes here run at 8 layers, tests/simulated/shallow.py);
  - the tiny LoRA recipe planned for a GPU with cpu_offload on 2 ranks: the offload path (host stand-ins, H2D
    copies), whose host bytes must match the plan's offloaded states."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.runs import forked_cli
from tests.simulated.shallow import shallow_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("recipe", "overrides", "world", "min_peak", "layers"), [
    ("recipes/hardware/llama-3.1-8b-lora-1x24gb.yaml", [], 1, 8.0e9 * 2, None),  # above the bf16 base alone
    ("recipes/tiny-lora-cpu.yaml", ["launch.device=cuda", "hardware.gpu=rtx4090-24gb"], 2, 1e6, None),
    # PyTorch FSDP2 on the simulated GPU (its streams and events: shardtune/simulated/device.py)
    ("recipes/tiny-cpu.yaml", ["launch.device=cuda", "hardware.gpu=rtx4090-24gb", "engine.backend=torch"], 2, 1e6,
     None),
    # DPO: the held-out eval at DPO's start reads its sums through accelerator.to_host (zeros when simulated)
    ("recipes/hardware/llama-3.1-8b-dpo-lora-1x24gb.yaml", [], 1, 4e9, 8),
    # DPO after an SFT warm-up (dpo.sft_warmup_steps=60): the simulated step is a DPO step, the one the plan
    # predicts, not a warm-up step of the chosen rows alone (ratio 0.61 when it was)
    ("recipes/tiny-dpo-cpu.yaml", ["launch.device=cuda", "hardware.gpu=rtx4090-24gb"], 2, 1e6, None),
])
def test_simulated_step_agrees_with_the_plan(recipe: str, overrides: list[str], world: int, min_peak: float,
                                             layers: int | None, tmp_path: Path) -> None:
    depth = [shallow_config(recipe, layers, tmp_path)] if layers else []
    out = forked_cli("plan", recipe, *overrides, *depth, "--simulate", "--json", cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    sim = json.loads(out.stdout)
    assert sim["world_size"] == world
    assert sim["simulated_peak_bytes"] > min_peak  # real allocations were counted
    assert abs(sim["simulated_peak_bytes"] / sim["analytic_peak_bytes"] - 1) <= 0.05, sim
    assert abs(sim["simulated_host_bytes"] - sim["analytic_host_bytes"]) <= 0.01 * sim["analytic_host_bytes"], sim
    # CUDA's allocators over the same step (simulated/allocator.py): blocks rounded up, segments reserved, pinned
    # host blocks rounded to powers of two.
    assert sim["allocator_reserved_peak_bytes"] >= sim["allocator_allocated_peak_bytes"] >= sim["simulated_peak_bytes"]
    assert sim["pinned_reserved_peak_bytes"] >= sim["simulated_host_bytes"]


def test_offloaded_host_agrees_with_the_plan(tmp_path: Path) -> None:
    """Full fine-tuning, hybrid_shard + cpu_offload over 2 nodes: the host holds the pinned shards and gradients as
    CUDA's pinned allocator sizes them (powers of two) and, over 2 micro-steps, one more reduced-gradient copy per
    unit waiting to be added; the plan counts the same bytes."""
    recipe = "recipes/hardware/llama-3.1-8b-full-8x80gb.yaml"
    out = forked_cli("plan", recipe, shallow_config(recipe, 8, tmp_path), "engine.strategy=hybrid_shard",
              "engine.cpu_offload=true", "launch.nnodes=2", "hardware.num_gpus=16", "--simulate", "--json",
              cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    sim = json.loads(out.stdout)
    assert sim["simulated_host_bytes"] > 16 * 3.0e9 / 8  # shards, grads, AdamW of 8 layers' 3B over 8 ranks
    assert abs(sim["simulated_host_bytes"] - sim["analytic_host_bytes"]) <= 0.01 * sim["analytic_host_bytes"], sim


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_sliding_window_band_is_planned(tmp_path: Path, dropout: float) -> None:
    """With attention dropout (no varlen kernel), documents longer than a sliding window run through the band
    (model/attention.py): k and v repeated to every head and saved, the blocks' outputs and their concatenation, the
    band bias. A Mistral twin with a window of 128 against the same model without one, over 1,024-token documents,
    no checkpointing (every layer's set alive): the plan's added bytes match the simulated step's within 5 %. No
    packing: the plan counts a packed row's per-document outputs and their concatenation as its worst case, which
    these one-document rows never make without a window; with one, the blocks' concatenation is saved (o_proj's
    LoRA input).
    Without dropout, the GPU's varlen kernel takes the window itself: neither the plan nor the step adds a byte."""
    import random

    rng = random.Random(0)
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(1500))}) + "\n"
                            for _ in range(16)))
    base = json.loads((REPO / "configs/models/mistral-7b.json").read_text())
    base.update(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096)
    peaks = {}
    for window in (128, None):
        cfg = tmp_path / f"mistral-window-{window}.json"
        cfg.write_text(json.dumps({**base, "sliding_window": window, "attention_dropout": dropout}))
        out = forked_cli("plan", "recipes/tiny-lora-cpu.yaml", f"model.config={cfg}", "model.tokenizer=builtin:char",
                  f"data.path={data}", "data.format=text", "data.seq_len=1024", "data.packing=false",
                  "train.micro_batch_size=1",
                  "engine.activation_checkpointing=false", "engine.cpu_offload=false", "launch.device=cuda",
                  "hardware.gpu=rtx4090-24gb", "launch.nproc_per_node=1", "hardware.num_gpus=1", "--simulate",
                  "--json", cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        sim = json.loads(out.stdout)
        peaks[window] = (sim["simulated_peak_bytes"], sim["analytic_peak_bytes"])
    simulated = peaks[128][0] - peaks[None][0]
    planned = peaks[128][1] - peaks[None][1]
    if dropout == 0.0:
        assert planned == 0 and abs(simulated) < 1024, (planned, simulated)
        return
    assert simulated > 2 * 1024 * 512 * 2  # more than the layers' repeated k/v alone
    assert abs(planned / simulated - 1) <= 0.05, (planned, simulated)
