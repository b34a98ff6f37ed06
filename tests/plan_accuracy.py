"""Plan vs measurement on CPU: the validation behind tests/integration/test_plan_accuracy.py and
bench/plan_accuracy.py.

Each configuration is a set of recipe overrides on a small Llama (written here, large enough that activations and
states dominate fixed overheads). Measurement is the real trainer (`shardtune.trainer.train.train`) with
`train.profile_memory=true`: rank 0 logs `peak_mem_bytes`, the max over ranks of the peak live tensor bytes in a
step (CPU tracker, shardtune/memory.py); we take the max over the steps (step 1 allocates AdamW state, later steps
hold it). Prediction is `plan` on the same recipe. One process group per world size runs all its configurations
(start-up dominates on small machines).
"""
from __future__ import annotations

import gc
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# A mixture of experts of the same scale (Qwen3-MoE: 8 experts, 2 active per token, fused 3-D expert weights).
MOE_MODEL = {**{k: v for k, v in MODEL.items() if k not in ("architectures", "model_type")},
             "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": 688,
             "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
             "head_dim": 32}
ARCHS = {"llama": MODEL, "moe": MOE_MODEL}

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
    vocab: int | None = None  # the own model with this vocabulary instead of MODEL's
    long_docs: bool = False  # data: LONG_DOCS text documents of `doc_chars` characters (char tokenizer)
    doc_chars: int = 0  # long_docs: characters per document (0: LONG_DOC_CHARS)
    arch: str = "llama"  # the own model: MODEL, or MOE_MODEL ("moe")


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
    transient of every matmul are what this table checks beyond the LoRA row of the default grid. torchao's
    whole-weight matmul (engine.nf4_tile_mb=0), the transient this table was built for; the tiled one is in
    VOCAB_GRID / VOCAB_SUBSET."""
    return [Case(f"w{w} qlora {mp_} mb{mb} s{s}" + (" ckpt" if ck else "") + (" vp-off" if off else ""), w,
                 ("engine.strategy=full_shard", f"engine.mixed_precision={mp_}", f"train.micro_batch_size={mb}",
                  f"data.seq_len={s}", f"engine.activation_checkpointing={'true' if ck else 'false'}", *QLORA,
                  "engine.nf4_tile_mb=0", *(("engine.vocab_parallel=false",) if off else ())))
            for w, mp_, mb, s, ck in QLORA_GRID
            # the rows at more than one rank run engine.vocab_parallel (the default); one keeps the gathered tables
            for off in [w == 2 and mp_ == "fp32"]]


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


# DPO: one forward of 2 x micro-batch rows (chosen + rejected); full fine-tuning with the reference
# precomputed before step 1, LoRA with a no-grad adapters-off forward per micro-step. Start DPO at step 1.
DPO = ("train.objective=dpo", "data.format=preference", "data.path=builtin:prefer-reverse", "dpo.sft_warmup_steps=0",
       "train.eval_every=0",
       # full fine-tuning's reference pass runs over every pair before step 1: 48 pairs (the two steps read at most
       # 8) keep it a second, where BASE's 300 took ten; the peak does not depend on the count
       "data.num_samples=48")
DPO_GRID = [  # world, micro-batch (pairs), seq_len, extra overrides
    (1, 2, 128, ()), (2, 2, 256, ()),
    (1, 2, 128, ("lora.enabled=true", "lora.r=8")), (2, 1, 256, ("lora.enabled=true", "lora.r=8")),
]


def dpo_grid() -> list[Case]:
    return [Case(f"w{w} dpo {'lora' if extra else 'full'} mb{mb} s{s}", w,
                 ("engine.strategy=full_shard", "engine.mixed_precision=fp32", f"train.micro_batch_size={mb}",
                  f"data.seq_len={s}", *DPO, *extra)) for w, mb, s, extra in DPO_GRID]


# Mixture of experts: every expert's parameters, the routed tokens' activations (top-k rows per token),
# NF4 experts and per-expert adapters; full fine-tuning, LoRA (attention + experts) and QLoRA, world 1/2, with and
# without activation checkpointing.
MOE_LORA = ("lora.enabled=true", "lora.r=8", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]")
MOE_GRID = [  # world, precision, micro-batch, seq_len, extra overrides (a label for the name)
    (1, "fp32", 2, 128, ("full",)), (2, "fp32", 2, 256, ("full",)),
    (2, "fp32", 2, 128, ("lora", *MOE_LORA)), (2, "fp32", 2, 128, ("qlora", *MOE_LORA, "lora.quantize_base=nf4")),
    # checkpointed: the peak is a MoE layer's recompute, holding the un-permute's rows (plan/moe.py unpermute_bytes)
    (2, "fp32", 2, 256, ("full ckpt", "engine.activation_checkpointing=true")),
    (2, "bf16", 2, 256, ("lora ckpt", *MOE_LORA, "engine.activation_checkpointing=true")),
]


def moe_grid() -> list[Case]:
    cases = []
    for world, mp_, mb, s, (label, *overrides) in MOE_GRID:
        cases.append(Case(f"w{world} moe {label} {mp_} mb{mb} s{s}", world,
                          ("engine.strategy=full_shard", f"engine.mixed_precision={mp_}",
                           f"train.micro_batch_size={mb}", f"data.seq_len={s}", *overrides), arch="moe"))
    return cases


def demo_grid(subset: bool = False) -> list[Case]:
    combos = DEMO_SUBSET if subset else [(r, mb, st, w) for r in DEMO_RECIPES for w in DEMO_WORLDS
                                         for st in DEMO_STRATEGIES for mb in DEMO_MICRO_BATCHES]
    return [Case(f"{r} w{w} {st} mb{mb}", w, (f"engine.strategy={st}", f"train.micro_batch_size={mb}",
                                               "train.save_every=0"), recipe=r, own_model=False)
            for r, mb, st, w in combos]


# Vocabulary features: a 32k vocabulary, where the logits dominate; chunked loss and tiled NF4 on and off.
VOCAB = 32000
VOCAB_GRID = [  # world, precision, micro-batch, seq_len, loss_chunk_tokens, extra overrides (a label for the name)
    (1, "fp32", 8, 512, 0, ()), (1, "fp32", 8, 512, 1024, ()),
    # 2 ranks: gathered tables with full logits, and the defaults (vocab_parallel, chunked loss)
    (2, "fp32", 8, 512, 0, ("vp-off", "engine.vocab_parallel=false")), (2, "fp32", 8, 512, 1024, ("vp",)),
    (2, "bf16", 4, 256, 0, ()), (2, "bf16", 4, 256, 1024, ()),
    (2, "fp32", 2, 256, 256, ("ckpt", "engine.activation_checkpointing=true")),
    (1, "bf16", 2, 512, 1024, ("lora", "lora.enabled=true", "lora.r=8")),
    (2, "fp32", 2, 256, 0, ("qlora untiled", *QLORA, "engine.nf4_tile_mb=0")),
    (2, "fp32", 2, 256, 1024, ("qlora tiled", *QLORA, "engine.nf4_tile_mb=0.125")),
]


# The test's share (tests/integration/test_plan_accuracy.py): features on and off at every world size, an 8k
# vocabulary and short rows so that the six runs add ~20 s to the spawns the other tables start anyway.
VOCAB_SUBSET = [
    (1, "fp32", 1, 256, 0, ()), (1, "bf16", 2, 128, 128, ()),
    (2, "fp32", 2, 128, 64, ("ckpt", "engine.activation_checkpointing=true")),
    # vp-off: with vocab_parallel and full logits (the all-to-all path) this row's measured peak varies from run to
    # run (28.7-30.8 MB against 28.8 predicted); with the gathered tables it is steady, so this row tests those
    (2, "bf16", 1, 128, 0, ("qlora untiled vp-off", *QLORA, "engine.nf4_tile_mb=0", "engine.vocab_parallel=false")),
    (4, "fp32", 1, 128, 32, ("qlora tiled", *QLORA, "engine.nf4_tile_mb=0.125")),
    (4, "bf16", 2, 128, 0, ("lora", "lora.enabled=true", "lora.r=8")),
]


def vocab_grid(subset: bool = False) -> list[Case]:
    """Chunked loss (train.loss_chunk_tokens) and tiled NF4 (engine.nf4_tile_mb) on and off, 32k vocabulary (the
    bench's table); `subset`: VOCAB_SUBSET at 8k (the test's)."""
    vocab = 8192 if subset else VOCAB
    cases = []
    for world, mp_, mb, s, chunk, extra in VOCAB_SUBSET if subset else VOCAB_GRID:
        label, *overrides = extra or ("",)
        name = f"w{world} v{vocab // 1000}k {mp_} mb{mb} s{s} chunk{chunk}" + (f" {label}" if label else "")
        cases.append(Case(name, world, ("engine.strategy=full_shard", f"engine.mixed_precision={mp_}",
                                        f"train.micro_batch_size={mb}", f"data.seq_len={s}",
                                        f"train.loss_chunk_tokens={chunk}",
                                        *(() if subset else ("data.num_samples=1500",)), *overrides),
                          vocab=vocab))
    return cases


# Long context (seq 8,192): packed rows of a few long documents (~3 per row), the tiny-llama demo model and its
# character tokenizer; checkpointing, activation offloading (host buffers counted apart by the tracker), LoRA, bf16
# and 2 ranks. Not here: engine.mlp_chunk_tokens, which the plan over-predicts at this size (+10.9 %, its
# unit-gradcat phase; bench/RESULTS.md, stop 46); at the 8B recipe's size --simulate agrees (ratio 0.9996).
LONG_DOCS, LONG_DOC_CHARS = 12, 2900
LONG_ROWS = ("train.micro_batch_size=1", "train.max_steps=1", "data.format=text")
LONG = ("data.seq_len=8192", *LONG_ROWS)
CK, OFF = "engine.activation_checkpointing=true", "engine.offload_activations=true"
CP = "engine.context_parallel=true"
LONG_GRID = [  # name, world, extra overrides
    ("w1 fp32 s8192", 1, ()), ("w1 fp32 s8192 ckpt", 1, (CK,)), ("w1 fp32 s8192 ckpt offload", 1, (CK, OFF)),
    ("w2 fp32 s8192", 2, ()),
    ("w2 fp32 s8192 ckpt offload", 2, (CK, OFF)),
    ("w2 bf16 s8192 lora ckpt offload", 2, ("engine.mixed_precision=bf16", "lora.enabled=true", CK, OFF)),
]
# engine.context_parallel: the plan takes the costliest rows, one document each (model/context_parallel.py pads the
# last rank's queries to the whole document); documents longer than the row, truncated to it. Rows of 4,096: the last
# rank's attention grows with the square of the document, and at 8,192 these two rows took 21 of the 47 s of the
# world-2 rows' training (bench/plan_accuracy_cost.py 2). Two steps: the second step's backward has the AdamW states
# (a step-1 peak has none, a few % of this small a step)
CP_SEQ, WHOLE_ROW_CHARS = 4096, 4500
CP_GRID = [("w2 fp32 s4096 context-parallel", 2, (CP, "train.max_steps=2")),
           ("w2 fp32 s4096 ckpt offload context-parallel", 2, (CK, OFF, CP, "train.max_steps=2"))]


def long_context_grid() -> list[Case]:
    return [*(Case(name, world, (*LONG, *extra), own_model=False, long_docs=True) for name, world, extra in LONG_GRID),
            *(Case(name, world, (f"data.seq_len={CP_SEQ}", *LONG_ROWS, *extra), own_model=False, long_docs=True,
                   doc_chars=WHOLE_ROW_CHARS) for name, world, extra in CP_GRID)]


def suite_tables() -> list[tuple[str, list[Case]]]:
    """The tables tests/integration/test_plan_accuracy.py runs, in its order: (title, rows). bench/plan_accuracy_cost.py
    times the same rows."""
    return [("validation grid", default_grid()), ("demo recipes", demo_grid(subset=True)), ("QLoRA", qlora_grid()),
            ("DPO", dpo_grid()), ("chunked loss / tiled NF4", vocab_grid(subset=True)), ("long context", long_context_grid()),
            ("mixture of experts", moe_grid())]


def _long_docs_file(workdir: Path, chars: int = 0) -> Path:
    return workdir / f"long_docs_{chars or LONG_DOC_CHARS}.jsonl"


def _long_model_file(workdir: Path) -> Path:
    """The demo's tiny-llama with positions up to the long rows' length (its own config stops at 512)."""
    return workdir / "model-long.json"


def _model_file(case: Case, workdir: Path) -> Path:
    if case.arch != "llama":
        return workdir / f"model-{case.arch}.json"
    return workdir / ("model.json" if case.vocab is None else f"model-v{case.vocab}.json")


def recipe_overrides(case: Case, workdir: Path, index: int) -> list[str]:
    model = [f"model.config={_model_file(case, workdir)}"] if case.own_model else []
    model += [f"model.config={_long_model_file(workdir)}", f"data.path={_long_docs_file(workdir, case.doc_chars)}"] \
        if case.long_docs else []
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
    from shardtune.trainer.runtime import init_runtime
    from shardtune.trainer.train import train

    torch.set_num_threads(1)
    init_runtime(load_recipe(*jobs[0]).launch)
    # What init made stays for the process's life: out of the collector's sight (as the imports are, frozen by the
    # rank server: tests/freeze_heap.py), the full collections of every run's tracker scan only what runs make.
    gc.freeze()
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
    from shardtune.bundled import CONFIGS_DIR

    tiny = json.loads((CONFIGS_DIR / "models" / "tiny-llama.json").read_text())
    _long_model_file(workdir).write_text(json.dumps({**tiny, "max_position_embeddings": 8192}))
    letters = "abcdefghijklmnopqrstuvwxyz "
    for chars in {c.doc_chars for c in cases if c.long_docs}:
        _long_docs_file(workdir, chars).write_text("".join(
            json.dumps({"text": "".join(letters[(i * 7 + j * j) % 27] for j in range(chars or LONG_DOC_CHARS))}) + "\n"
            for i in range(LONG_DOCS)))
    for c in cases:
        if c.vocab is not None:
            _model_file(c, workdir).write_text(json.dumps({**MODEL, "vocab_size": c.vocab}))
        elif c.arch != "llama":
            _model_file(c, workdir).write_text(json.dumps(ARCHS[c.arch]))
    by_world: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_world.setdefault(c.world, []).append(i)
    from shardtune.trainer.runtime import free_port
    from tests.ranks import start_local_ranks

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
