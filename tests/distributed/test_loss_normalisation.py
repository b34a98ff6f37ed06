"""The trainer's loss normalisation: W=1 x A=4, W=2 x A=2 and W=4 x A=1 give the same loss and the same gradient
for every parameter (fp32), through the real data pipeline (GlobalBatches over builtin:reverse) and trainer loss."""
from __future__ import annotations

import torch
import torch.distributed as dist
from tests.distributed.harness import run_distributed

from shardtune.config import load_recipe
from shardtune.data import GlobalBatches, build_data
from shardtune.model.build import build_model, build_tokenizer
from shardtune.trainer.evaluate import token_loss_sum

OVERRIDES = ["data.num_samples=200", "data.seq_len=32", "train.micro_batch_size=2", "model.attn_implementation=eager"]


def grads_after_one_step(world: int, accum: int, rank: int, backend: str | None) -> tuple[float, dict]:
    recipe = load_recipe("tiny-cpu", OVERRIDES + [f"train.grad_accum={accum}"])
    tok = build_tokenizer(recipe.model)
    data = build_data(recipe.data, tok, seed=0)
    model = build_model(recipe.model, seed=0)
    if backend is not None:  # wrap only; the hooks do the rest (gradients summed over ranks)
        from shardtune.trainer.parallelize import parallelize

        recipe.engine.backend = backend
        parallelize(model, recipe, device=torch.device("cpu"), world_size=world)
    batches = GlobalBatches(data.train, micro_batch_size=2, grad_accum=accum, world_size=world, seed=0)
    micro, total = batches.step(3, rank)
    loss_sum = 0.0
    for mb in micro:
        loss = token_loss_sum(model, mb.input_ids, mb.labels, mb.position_ids) / total
        loss.backward()
        loss_sum += loss.item()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    if world > 1:
        t = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(t)
        loss_sum = float(t)
    return loss_sum, grads


def _dist_case(world: int, accum: int, out: str) -> None:
    loss, grads = grads_after_one_step(world, accum, dist.get_rank(), backend="torch")
    if dist.get_rank() == 0:
        torch.save((loss, grads), out)


def test_world_times_accum_is_invariant(tmp_path):
    ref_loss, ref_grads = grads_after_one_step(1, 4, 0, backend=None)  # plain single process, no wrapping
    for world, accum in [(2, 2), (4, 1)]:
        out = tmp_path / f"w{world}.pt"
        run_distributed(_dist_case, world, [{"world": world, "accum": accum, "out": str(out)}])
        loss, grads = torch.load(out)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (world, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{name} at W={world}")
