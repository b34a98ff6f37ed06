"""A recipe's model cut to a few decoder layers, for simulated steps at full width: every per-layer path (offload,
NF4, experts, checkpointing) still runs, layer after layer, and the plan is computed for the same model, so their
agreement is checked in a fraction of the time. Full depth is bench/plan_vs_simulate.py's (bench/RESULTS.md)."""
from __future__ import annotations

import json
from pathlib import Path

from shardtune.config.load import load_recipe


def shallow_config(recipe: str, layers: int, tmp: Path) -> str:
    """The override `model.config=...` pointing at a copy of `recipe`'s model config with `layers` decoder layers."""
    config = json.loads(Path(load_recipe(recipe).model.config).read_text())
    config["num_hidden_layers"] = layers
    config.pop("layer_types", None)  # per-layer lists follow num_hidden_layers (transformers rebuilds them)
    path = tmp / f"config-{layers}-layers.json"
    path.write_text(json.dumps(config))
    return f"model.config={path}"
