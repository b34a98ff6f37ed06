"""Sharded loading (model.init=pretrained): meta build, each rank reads only its pieces; equals from_pretrained,
single-file and multi-file (index) checkpoints, as safetensors and as PyTorch .bin files; peak host bytes while loading <= own shards + largest tensor. A tied
model (tiny-qwen2: its checkpoint holds no lm_head.weight) is built tied and loads."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tests.distributed.common import build_model, policy_for
from tests.distributed.harness import grid, run_distributed
from transformers import AutoModelForCausalLM

from shardtune.engine.shard import shard_model
from shardtune.memory import CpuMemoryTracker
from shardtune.model.loading import build_empty, load_into_shards


def _as_bin(src: Path, dst: Path) -> None:
    """The safetensors checkpoint `src` re-saved as transformers' PyTorch format: pytorch_model.bin, or
    pytorch_model-0000i-of-0000n.bin shards with pytorch_model.bin.index.json; config.json beside them."""
    files = sorted(src.glob("*.safetensors"))
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    names = ["pytorch_model.bin"] if len(files) == 1 else \
        [f"pytorch_model-{i + 1:05d}-of-{len(files):05d}.bin" for i in range(len(files))]
    weight_map = {}
    for f, name in zip(files, names, strict=True):
        tensors = load_file(f)
        torch.save(tensors, dst / name)
        weight_map.update(dict.fromkeys(tensors, name))
    if len(files) > 1:
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _load(root: str, sharded_files: bool, name: str = "tiny-llama", fmt: str = "safetensors") -> None:
    path = Path(root) / name / ("multi" if sharded_files else "single")
    if dist.get_rank() == 0 and not path.exists():
        build_model(name, seed=3).save_pretrained(path, max_shard_size="300KB" if sharded_files else "1GB")
        _as_bin(path, path.with_name(path.name + "-bin"))
    dist.barrier()
    assert (path / "model.safetensors.index.json").exists() == sharded_files
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    if fmt == "bin":  # the same weights, read from the .bin copy
        path = path.with_name(path.name + "-bin")
        assert not any(path.glob("*.safetensors"))
        assert (len(list(path.glob("*.bin"))) > 1) == sharded_files == (path / "pytorch_model.bin.index.json").exists()
    largest = max(p.nbytes for p in ref.parameters())

    model = build_empty(lambda: AutoModelForCausalLM.from_config(ref.config, attn_implementation="eager"))
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == ref.config.tie_word_embeddings  # accelerate's meta build untied them once
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    sharded = shard_model(model, policy_for(model, "full_shard", world=dist.get_world_size()),
                          device=torch.device("cpu"))
    flats = [f for u in sharded.units for f in u.flats]
    load_into_shards(flats, model, path)
    peak = tracker.peak_bytes() - base
    tracker.stop()
    shard_bytes = sum(f.shard.nbytes for f in flats)
    # A .bin file is mapped (torch.load(mmap=True)): its tensors are storages the tracker counts, though their
    # pages are the file's page cache, read only where a rank's rows are. Bounded by the files' size, not copies.
    mapped = sum(f.stat().st_size for f in path.glob("*.bin"))
    assert peak <= shard_bytes + largest + mapped, (peak, shard_bytes, largest, mapped)

    full = dict(sharded.full_state_dict())  # rank 0 only
    if dist.get_rank() == 0:
        expected = dict(ref.named_parameters())
        assert set(full) == set(expected)
        for name, t in full.items():
            torch.testing.assert_close(t, expected[name].detach(), rtol=0, atol=0)
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        torch.testing.assert_close(b, rb, rtol=0, atol=0, msg=name)  # rotary inv_freq computed, not meta
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_sharded_loading_2_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_load, 2, grid(root=[tmp], sharded_files=[False, True], name=["tiny-llama", "tiny-qwen2"])
                        + grid(root=[tmp], sharded_files=[False, True], fmt=["bin"]))


def test_sharded_loading_4_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_load, 4, grid(root=[tmp], sharded_files=[True]))
