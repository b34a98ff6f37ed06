"""Plan vs measurement on CPU: the validation behind tests/integration/test_plan_accuracy.py and
bench/plan_accuracy.py.

Each configuration is a set of recipe overrides on a small Llama (written here, large enough that activations and
states dominate fixed overheads). Measurement is the real trainer (`shardtune.train.train`) with
`train.profile_memory=true`: rank 0 logs `peak_mem_bytes`, the max over ranks of the peak live tensor bytes in a
step (CPU tracker, shardtune/memory.py); we take the max over the steps (step 1 allocates AdamW state, later steps
hold it). Prediction is `plan` on the same recipe. One process group per world size runs all its configurations
(start-up dominates on small machines).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

BASE = ["train.max_steps=2", "train.profile_memory=true", "train.demo_eval=false", "train.save_final=false",
        "train.eval_every=0", "data.eval_fraction=0.0", "data.num_samples=300", "train.warmup_steps=0",
        "launch.device=cpu", "launch.threads_per_worker=1", "hardware.gpu=cpu"]


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    overrides: tuple[str, ...]
    recipe: str = "tiny-cpu"
    own_model: bool = True  # False: the recipe's own model (the demo recipes as users run them)


GRID = [  # world, strategy, precision, micro-batch, seq_len, extra overrides (a label for the name)
    (1, "full_shard", "fp32", 1, 128, ()), (1, "full_shard", "fp32", 2, 256, ()),
    (1, "full_shard", "bf16", 1, 128, ()), (1, "full_shard", "bf16", 2, 256, ("ckpt", "engine.activation_checkpointing=true")),
    (2, "full_shard", "fp32", 2, 128, ()), (2, "full_shard", "bf16", 1, 256, ()),
    (2, "shard_grad_op", "fp32", 2, 128, ()), (2, "no_shard", "fp32", 2, 128, ()),
    (2, "full_shard", "bf16", 1, 256, ("lora", "lora.enabled=true", "lora.r=8")),
    # every-2 checkpointing: the last unit is not checkpointed, the peak is in a middle unit's backward
    (2, "full_shard", "fp32", 2, 128, ("offload ckpt2", "engine.cpu_offload=true", "engine.activation_checkpointing=2")),
    (4, "full_shard", "fp32", 1, 128, ()), (4, "hybrid_shard", "bf16", 1, 128, ("", "engine.hybrid_shard_size=2")),
]


def default_grid() -> list[Case]:
    """World size 1/2/4 x strategy x precision x micro-batch x seq_len, with activation checkpointing (every unit,
    every 2nd), CPU offload and LoRA in place of configurations the others already cover (to keep the runtime)."""
    cases = []
    for world, strat, mp_, mb, s, extra in GRID:
        label, *overrides = extra or ("",)
        name = f"w{world} " + (f"{strat} " if world > 1 else "") + f"{mp_} mb{mb} s{s}" + (f" {label}" if label else "")
        cases.append(Case(name, world, (f"engine.strategy={strat}", f"engine.mixed_precision={mp_}",
                                        f"train.micro_batch_size={mb}", f"data.seq_len={s}", *overrides)))
    return cases


# QLoRA (lora.quantize_base=nf4): a separate table, world 1/2/4 x checkpointing on/off x bf16/fp32 compute.
QLORA = ("lora.enabled=true", "lora.r=8", "lora.quantize_base=nf4",
         "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
QLORA_GRID = [  # world, precision, micro-batch, seq_len, activation checkpointing
    (1, "fp32", 1, 128, False), (1, "bf16", 2, 256, True),
    (2, "fp32", 2, 128, True), (2, "bf16", 1, 256, False),
    (4, "fp32", 1, 128, False), (4, "bf16", 1, 128, True),
]


def qlora_grid() -> list[Case]:
    """QLoRA over an NF4 base, full_shard: the NF4 byte buffers, the gathered NF4 units and the dequantization
    transient of every matmul are what this table checks beyond the LoRA row of the default grid."""
    return [Case(f"w{w} qlora {mp_} mb{mb} s{s}" + (" ckpt" if ck else ""), w,
                 ("engine.strategy=full_shard", f"engine.mixed_precision={mp_}", f"train.micro_batch_size={mb}",
                  f"data.seq_len={s}", f"engine.activation_checkpointing={'true' if ck else 'false'}", *QLORA))
            for w, mp_, mb, s, ck in QLORA_GRID]


# Demo recipes as shipped (tiny-llama, seq_len 128), kept apart from the grid above (and from other features' rows):
# recipe x micro-batch x strategy x world size. The full product is the bench's; the test runs DEMO_SUBSET.
DEMO_RECIPES = ("tiny-cpu", "tiny-lora-cpu")
DEMO_MICRO_BATCHES = (1, 2, 4, 8)
DEMO_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
DEMO_WORLDS = (1, 2, 4)
# Every recipe, micro-batch, strategy and world size at least once; each world's cases share one spawn.
DEMO_SUBSET = [("tiny-cpu", 1, "full_shard", 1), ("tiny-cpu", 8, "shard_grad_op", 2), ("tiny-cpu", 2, "no_shard", 4),
               ("tiny-lora-cpu", 4, "full_shard", 2), ("tiny-lora-cpu", 8, "no_shard", 1),
               ("tiny-lora-cpu", 1, "shard_grad_op", 4)]


def demo_grid(subset: bool = False) -> list[Case]:
    combos = DEMO_SUBSET if subset else [(r, mb, st, w) for r in DEMO_RECIPES for w in DEMO_WORLDS
                                         for st in DEMO_STRATEGIES for mb in DEMO_MICRO_BATCHES]
    return [Case(f"{r} w{w} {st} mb{mb}", w, (f"engine.strategy={st}", f"train.micro_batch_size={mb}",
                                               "train.save_every=0"), recipe=r, own_model=False)
            for r, mb, st, w in combos]


def recipe_overrides(case: Case, workdir: Path, index: int) -> list[str]:
    model = [f"model.config={workdir / 'model.json'}"] if case.own_model else []
    return [*model, *BASE, f"launch.nproc_per_node={case.world}", f"train.output_dir={workdir / f'run{index}'}",
            *case.overrides]


def predict(case: Case, workdir: Path, index: int) -> int:
    from shardtune.plan import make_plan

    return make_plan(case.recipe, recipe_overrides(case, workdir, index)).estimate.total


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from shardtune import memory
    from shardtune.config.load import load_recipe
    from shardtune.runtime import init_runtime
    from shardtune.train import train

    torch.set_num_threads(1)
    init_runtime(load_recipe(*jobs[0]).launch)
    try:
        for recipe_name, overrides in jobs:
            # Bytes still alive from the previous run in this process (the engine's hooks keep a trained model
            # alive: a reference cycle through autograd's C++ hooks); the tracker counts them, so we subtract them.
            leftover = torch.tensor([memory.snapshot_live_bytes()], dtype=torch.float64)
            dist.all_reduce(leftover, op=dist.ReduceOp.MIN)
            recipe = load_recipe(recipe_name, overrides)
            if rank == 0:
                Path(recipe.train.output_dir).mkdir(parents=True, exist_ok=True)
                (Path(recipe.train.output_dir) / "leftover_bytes").write_text(str(int(leftover.item())))
            train(recipe)
            for t in list(memory._ACTIVE)[::-1]:  # train() leaves its tracker on; the next run starts a new one
                t.stop()
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(cases: list[Case], workdir: Path) -> list[int]:
    """Max over steps of peak_mem_bytes for each case; one spawn per world size."""
    (workdir / "model.json").write_text(json.dumps(MODEL))
    by_world: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_world.setdefault(c.world, []).append(i)
    from shardtune.runtime import free_port, start_local_ranks

    for world, idx in by_world.items():
        jobs = [(cases[i].recipe, recipe_overrides(cases[i], workdir, i)) for i in idx]
        start_local_ranks(_worker, (world, free_port(), jobs), world)  # forked ranks measure what spawned ones do
    out = []
    for i in range(len(cases)):
        run_dir = workdir / f"run{i}"
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        leftover = int((run_dir / "leftover_bytes").read_text())
        out.append(max(json.loads(x)["peak_mem_bytes"] for x in lines if "peak_mem_bytes" in x) - leftover)
    return out


def run(cases: list[Case] | None = None, workdir: Path | None = None) -> list[dict]:
    """[{name, world, predicted, measured, error}] with error = predicted / measured - 1."""
    cases = cases or default_grid()
    with tempfile.TemporaryDirectory() as tmp:
        wd = Path(workdir or tmp)
        wd.mkdir(parents=True, exist_ok=True)
        measured = measure(cases, wd)
        predicted = [predict(c, wd, i) for i, c in enumerate(cases)]
    return [{"name": c.name, "world": c.world, "predicted": p, "measured": m, "error": p / m - 1}
            for c, p, m in zip(cases, predicted, measured, strict=True)]
