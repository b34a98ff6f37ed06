"""plan's torch-only model build (plan/skeleton.py) against the real HF build, for every bundled model config."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.bundled import CONFIGS_DIR
from shardtune.config.load import load_recipe
from shardtune.plan import skeleton
from shardtune.plan.stats import Dims, ModelStats

ALL_MODELS = sorted((CONFIGS_DIR / "models").glob("*.json"))


def _is_moe(path: Path) -> bool:
    raw = json.loads(path.read_text())
    return bool(raw.get("num_experts") or raw.get("num_local_experts"))


# Mixtures of experts are planned on transformers' own meta build (their fused 3-D experts have no stand-in here).
MODELS = [p for p in ALL_MODELS if not _is_moe(p)]
MOE_MODELS = [p for p in ALL_MODELS if _is_moe(p)]


def _tree(model: torch.nn.Module) -> tuple:
    params = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]
    classes = [(n, type(m).__name__) for n, m in model.named_modules()  # holders of params/buffers, not act_fn
               if any(True for _ in m.parameters()) or any(True for _ in m.buffers(recurse=False))]
    return params, buffers, classes, getattr(model, "_no_split_modules", None)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_skeleton_matches_hf_model_on_meta(path: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(path.read_text())
    assert skeleton.supported(raw), f"{path.name}: plan would import transformers for it"
    raw["num_hidden_layers"] = 2  # every block is the same; the real 405B takes seconds on meta
    small = tmp_path / "config.json"
    small.write_text(json.dumps(raw))
    hf_config = AutoConfig.from_pretrained(small)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    ours = skeleton.build_skeleton(raw, torch.bfloat16)
    hp, hb, hc, hn = _tree(hf)
    op, ob, oc, on = _tree(ours)
    assert op == hp
    assert ob == hb
    assert oc == hc
    assert set(on) == set(hn)
    assert Dims.from_config(skeleton.config_namespace(raw)) == Dims.from_config(hf_config)
    # engine.mlp_chunk_tokens runs the post-attention norm inside the MLP's chunks where HF's block source says its
    # output feeds only the MLP; the skeleton's block declares the same (the plan counts one b·s·h less)
    from shardtune.model.tiled_mlp import norm_feeds_only_mlp

    assert norm_feeds_only_mlp(hf.model.layers[0]) and norm_feeds_only_mlp(ours.model.layers[0])


@pytest.mark.parametrize("path", MOE_MODELS, ids=lambda p: p.stem)
def test_mixtures_of_experts_are_planned_through_transformers(path: Path) -> None:
    assert not skeleton.supported(json.loads(path.read_text()))


def test_unknown_architecture_falls_back_to_transformers(tmp_path: Path) -> None:
    raw = json.loads((MODELS[0].parent / "tiny-llama.json").read_text())
    raw.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2, n_head=4)
    (tmp_path / "gpt2.json").write_text(json.dumps(raw))
    assert not skeleton.supported(raw)
    stats = ModelStats(load_recipe("tiny-cpu", [f"model.config={tmp_path / 'gpt2.json'}", "engine.wrap=[GPT2Block]"]))
    assert type(stats.model).__name__ == "GPT2LMHeadModel" and stats.num_params > 0
