"""engine.vocab_parallel: the embedding and head sharded by vocabulary rows, never gathered (engine/vocab.py).

8 steps of full fine-tuning, LoRA and QLoRA on 2 and 4 ranks (full_shard, and hybrid 2 x 2; Qwen2 at 4 ranks:
hybrid), Llama (untied, with a padding_idx), Qwen2 and Qwen3 (tied embedding and head), all with a 131-token
vocabulary that no world size divides, equal one process on the old path (full fp32 logits, gathered tables,
torchao's whole-weight NF4) per step within 1e-5 relative. Then the chunked eval loss, the full-logits path
(all-to-all) and its gradient, full_state_dict against the reference, and a DCP checkpoint (one entry per original
parameter) that loads into the gathered-table layout (vocab_parallel off) with the same weights and AdamW state.
Also FSDP2 with the embedding and head as units of their own, and the offload path. One spawn per world size.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from tests.distributed.common import adamw, computed_by_one_rank, global_batch, num_targets, policy_for
from tests.distributed.harness import run_distributed
from tests.distributed.test_chunked_loss import NUM_STEPS, nf4_reference_weights
from tests.distributed.test_chunked_loss import _model as chunked_model
from tests.distributed.test_chunked_loss import _steps as chunked_steps
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.bundled import CONFIGS_DIR
from shardtune.engine import shard as shardtune_backend
from shardtune.engine.loss import token_loss_sum

CHUNK = 5  # tokens per chunk: divides neither a rank's tokens nor the gathered ones
VOCAB = 131  # prime: 2 and 4 ranks both pad the tables (33 rows per rank at 4: the last rank holds 32)


def build(name: str) -> torch.nn.Module:
    base = "tiny-qwen2" if name == "tiny-qwen2" else "tiny-llama"
    cfg = AutoConfig.from_pretrained(str(CONFIGS_DIR / "models" / f"{base}.json"))
    if name == "tiny-qwen3":  # gemma/qwen3-style: one table for the embedding and the head
        from transformers import Qwen3Config
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id")
        cfg = Qwen3Config(**{k: getattr(cfg, k) for k in keep}, head_dim=32)
        cfg.tie_word_embeddings = True
    cfg.vocab_size = VOCAB
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def _model(name: str, mode: str):
    return chunked_model(name, mode, build=build)


def _batch(step: int, world: int, rank: int):
    ids, labels = global_batch(step, vocab=VOCAB)
    total = num_targets(labels)
    ids, labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
    return ids, labels, torch.arange(ids.shape[1]).expand_as(ids), total


def _steps(model, sharded, opt, *, chunk: int) -> list[float]:
    return chunked_steps(model, sharded, opt, chunk=chunk, batch=functools.partial(global_batch, vocab=VOCAB))


@functools.cache
def _reference(name: str, mode: str):
    """One process, the old path: full logits, whole tables, torchao's whole-weight NF4 matmul for QLoRA. One rank
    trains it; the others get its losses and trained parameters and rebuild the rest (seeded, as it was built)."""
    def untrained() -> torch.nn.Module:
        model = _model(name, mode)
        if mode == "qlora":
            nf4_reference_weights(model)
        return model

    def run() -> tuple[list[float], dict[str, torch.Tensor]]:
        model = untrained()
        losses = _steps(model, None, adamw(model), chunk=0)
        return losses, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    losses, trained = computed_by_one_rank(f"vocab {name} {mode}", run)
    model = untrained()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(trained.pop(n))
    assert not trained, sorted(trained)
    return model, losses


def _fsdp2_parity(name: str, mode: str) -> None:
    """engine.backend=torch with vocab_parallel: the untied embedding and head are FSDP2 units of their own."""
    from torch.distributed.fsdp import FSDPModule

    from shardtune.engine import torch_backend

    _, ref = _reference(name, mode)
    model = _model(name, mode)
    policy = policy_for(model, "full_shard", world=dist.get_world_size(), lora=None if mode == "full" else "lora")
    sharded = torch_backend.shard_model(model, policy, device=torch.device("cpu"))
    tables = [model.get_input_embeddings(), model.get_output_embeddings()]
    assert all(isinstance(m, FSDPModule) for m in tables) == (name == "tiny-llama")  # tied: one table, in the root
    losses = _steps(model, sharded, adamw(sharded.optimizer_param_groups(0.1)), chunk=CHUNK)
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)


def _parity(name: str, mode: str, strategy: str = "full_shard", backend: str = "shardtune",
            offload: bool = False) -> None:
    if backend == "torch":
        return _fsdp2_parity(name, mode)
    ref_model, ref = _reference(name, mode)
    model = _model(name, mode)
    world, rank = dist.get_world_size(), dist.get_rank()
    policy = policy_for(model, strategy, world=world, cpu_offload=offload, lora={"full": None, "lora": "lora", "qlora": "nf4"}[mode])
    if mode == "qlora":  # tiles of 16 KiB: 4 to 16 per weight of the tiny model (the default 64 MB is one)
        policy = dataclasses.replace(policy, nf4_tile_bytes=16384)
    sharded = shardtune_backend.shard_model(model, policy, device=torch.device("cpu"))
    tables = [f for f in sharded.units[-1].flats if f.local]
    assert len(tables) == (1 if name != "tiny-llama" else 2), "tied: one table; untied: embedding and head"
    opt = adamw(sharded.optimizer_param_groups(0.1))
    losses = _steps(model, sharded, opt, chunk=CHUNK)
    for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    assert all(f.full.numel() == 0 for f in tables), "a table was gathered"
    # Eval: the chunked loss and the full-logits path (all-to-all) equal the reference model's loss
    ids, labels, pos, _ = _batch(NUM_STEPS, world, rank)
    with torch.no_grad():
        want = token_loss_sum(ref_model, ids, labels, pos, chunk_tokens=0)
        for c in (CHUNK, 0):
            got = token_loss_sum(model, ids, labels, pos, chunk_tokens=c)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # The full-logits path's gradient w.r.t. this rank's final hidden states and the logits themselves
    head = model.get_output_embeddings()
    h = torch.randn(3, 2 + rank, ref_model.config.hidden_size, requires_grad=True)  # token counts differ per rank
    logits = head(h)
    want_logits = h @ ref_model.get_output_embeddings().weight.t()
    # The trained rows track the reference's to ~1e-5 each (test_parity.py's final check); a logit sums H of them
    # times N(0, 1) entries: ~sqrt(H)·1e-5.
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-4)
    (logits * torch.arange(VOCAB)).sum().backward()
    g = h.grad.clone()
    h.grad = None
    (want_logits * torch.arange(VOCAB)).sum().backward()
    opt.zero_grad(set_to_none=True)  # that backward also reached the head's rows (full fine-tuning)
    # 8 steps of fp32 training apart (weights agree to ~1e-7) and sums in another order: compared as a whole
    assert (g - h.grad).norm() <= 1e-5 * h.grad.norm(), ((g - h.grad).norm(), h.grad.norm())
    # The exported weights (one entry per original parameter) equal the reference's
    full = dict(sharded.full_state_dict())
    if rank == 0:
        ref_sd = {k: v for k, v in ref_model.state_dict().items()}
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            key = next((n for n in full if n.endswith(k)), None)
            if key is None:
                continue
            want_w = next(v for n, v in ref_sd.items() if n.endswith(k))
            # AdamW normalizes: a near-zero gradient summed in another order moves a weight by up to ~lr·1e-2
            torch.testing.assert_close(full[key], want_w.float(), rtol=1e-4, atol=2e-5)
    if mode == "full" and strategy == "full_shard" and not offload:
        _checkpoint_round_trip(name, sharded, opt, policy, full)


def _checkpoint_round_trip(name, sharded, opt, policy, full) -> None:
    """Saved with row-sharded tables, loaded where the tables sit in the gathered root (vocab_parallel off): the
    checkpoint format does not change."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    box = [tempfile.mkdtemp(prefix="vp_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    dcp.save(sharded.checkpoint_state(opt), checkpoint_id=box[0])
    model2 = build(name)
    other = shardtune_backend.shard_model(model2, dataclasses.replace(policy, vocab_parallel=False),
                                          device=torch.device("cpu"))
    assert not any(f.local for f in other.units[-1].flats)
    opt2 = adamw(other.optimizer_param_groups(0.1))
    state = other.checkpoint_state(opt2, for_load=True)
    dcp.load(state, checkpoint_id=box[0])
    other.load_checkpoint_state(state, opt2)
    loaded = dict(other.full_state_dict())
    if dist.get_rank() == 0:
        assert loaded.keys() == full.keys()
        for k in full:
            torch.testing.assert_close(loaded[k], full[k], rtol=0, atol=0)
    # AdamW moments too: one more step from each gives the same weights
    ids, labels, pos, total = _batch(NUM_STEPS + 1, dist.get_world_size(), dist.get_rank())
    for model_, sharded_, opt_ in ((sharded.module, sharded, opt), (model2, other, opt2)):
        (token_loss_sum(model_, ids, labels, pos, chunk_tokens=CHUNK) / total).backward()
        sharded_.clip_grad_norm_(1.0)
        opt_.step()
        opt_.zero_grad(set_to_none=True)
    a, b = dict(sharded.full_state_dict()), dict(other.full_state_dict())
    if dist.get_rank() == 0:
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_vocab_parallel_two_ranks():
    settings = [{"name": n, "mode": m} for n in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
                for m in ("full", "lora", "qlora")]
    settings += [{"name": n, "mode": m, "backend": "torch"} for n in ("tiny-llama", "tiny-qwen3") for m in ("full", "lora")]
    # cpu_offload: the rows live on the host and are copied per use (the offload path runs on CPU too)
    settings += [{"name": "tiny-llama", "mode": m, "offload": True} for m in ("full", "qlora")]
    run_distributed(_parity, 2, settings)


def test_vocab_parallel_four_ranks():
    settings = [{"name": n, "mode": m, "strategy": s} for n in ("tiny-llama", "tiny-qwen3")
                for m in ("full", "lora", "qlora") for s in ("full_shard", "hybrid_shard")]
    settings += [{"name": "tiny-qwen2", "mode": m, "strategy": "hybrid_shard"} for m in ("full", "lora", "qlora")]
    run_distributed(_parity, 4, settings)
