"""The settings matrix: every pair of values of the settings below runs a step (under the allocator model), a save,
a resume, an export and a greedy generation on the simulated GPU (every rank a process, every collective checked
across ranks: simulated/process_group.py), through the same recipe -> engine path as `train` (recipe overrides on
tiny-cpu, `train.setup`).

The rows are an all-pairs covering array (pairwise.py). A row the product refuses (`load_recipe` or `check_world`
raises the UserError `shardtune validate` prints) is not run: test_matrix.py asserts the refusal through the executable.
Rows of one world size run in one start of ranks; each row's outcome (None, or the failing rank's traceback) is
written to a file per rank, so one failing row does not hide the others (test_matrix.py reports them per row).
"""
from __future__ import annotations

import functools
import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardtune import accelerator
from shardtune.config.load import load_recipe
from shardtune.config.schema import check_world
from shardtune.errors import UserError
from shardtune.memory import recheck_min_bytes
from shardtune.model.moe_checks import model_problems
from shardtune.simulated.allocator import AllocatorTracker
from shardtune.simulated.fsdp2_offload import is_nf4
from shardtune.simulated.host import is_host
from shardtune.simulated.process_group import new_epoch, set_check_timeout
from shardtune.trainer import train as T
from shardtune.trainer.evaluate import exact_match
from shardtune.trainer.export import save_final
from shardtune.trainer.runtime import host_max
from tests.simulated.pairwise import Row, all_pairs

FACTORS: dict[str, list[Any]] = {
    "world": [1, 2, 4, 8],
    "strategy": ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"],
    "precision": ["fp32", "bf16"],
    "reduce_dtype": ["fp32", "bf16"],
    "checkpointing": [False, True],
    "offload": [False, True],
    "tuning": ["full", "lora", "qlora"],
    "vocab_parallel": [True, False],
    "shard_adapter_states": [True, False],
    "backend": ["shardtune", "torch"],
    "objective": ["sft", "dpo", "grpo"],
    "grad_accum": [1, 2],
    # Beyond the list, what later options let a user write: a mixture of experts (tiny-moe-cpu), the long
    # context options, and micro-batches of several rows (a chunk of the sequence across rows once broke MoE blocks)
    "model": ["dense", "moe"],
    "long_context": ["off", "offload_activations", "mlp_chunk", "both"],
    "rows": [1, 2],
    "context_parallel": [False, True],
}
RECIPES = {"dense": "tiny-cpu", "moe": "tiny-moe-cpu"}
LONG_CONTEXT = {"off": (), "offload_activations": ("engine.offload_activations=true",),
                "mlp_chunk": ("engine.mlp_chunk_tokens=16",),  # 32-token rows: 2 chunks per row or more
                "both": ("engine.offload_activations=true", "engine.mlp_chunk_tokens=16")}
# Tiny and short: 1 micro-batch of 1 or 2 rows per rank per step, 32 tokens.
BASE = ("data.num_samples=48", "data.seq_len=32", "data.eval_fraction=0.1",
        "train.max_steps=2", "train.warmup_steps=0", "train.save_every=0", "train.demo_eval=false",
        "train.keep_last=0")
TUNING = {"full": (), "lora": ("lora.enabled=true", "lora.r=4", "lora.alpha=8"),
          "qlora": ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.quantize_base=nf4")}
DPO = ("train.objective=dpo", "data.format=preference", "data.path=builtin:prefer-reverse")
# GRPO's step samples 2 completions of 2 tokens per prompt on the simulated GPU (the held-out greedy ones first; top-k
# then top-p, so the sampler's sort and filter run there too), keeps the sampling policy's log-probs (num_iterations
# 2) and the reference's (beta > 0: under LoRA a forward with the adapters off, under full fine-tuning the frozen
# sharded copy of the starting weights, trainer/reference.py), then steps on them
GRPO = ("train.objective=grpo", "data.format=prompt", "data.path=builtin:prompt-reverse", "grpo.num_generations=2",
        "grpo.max_new_tokens=2", "grpo.num_iterations=2", "grpo.top_k=8", "grpo.top_p=0.9", "grpo.beta=0.04")
OBJECTIVE = {"sft": lambda row: (), "dpo": lambda row: DPO, "grpo": lambda row: GRPO}


def overrides(row: Row) -> list[str]:
    """The recipe overrides a user would write for `row` (beside BASE)."""
    out = [f"engine.strategy={row['strategy']}", f"engine.mixed_precision={row['precision']}",
           f"engine.reduce_dtype={row['reduce_dtype']}", f"engine.activation_checkpointing={row['checkpointing']}",
           f"engine.cpu_offload={row['offload']}", f"engine.vocab_parallel={row['vocab_parallel']}",
           f"engine.shard_adapter_states={row['shard_adapter_states']}", f"engine.backend={row['backend']}",
           f"train.grad_accum={row['grad_accum']}", f"launch.nproc_per_node={row['world']}", *TUNING[row["tuning"]],
           *OBJECTIVE[row["objective"]](row), *LONG_CONTEXT[row["long_context"]],
           f"train.micro_batch_size={row['rows']}", f"engine.context_parallel={row['context_parallel']}"]
    if row["strategy"] == "hybrid_shard":  # 2 replicas of W/2 ranks: 2x2 at W=4, 2x4 at W=8
        out.append(f"engine.hybrid_shard_size={max(1, row['world'] // 2)}")
    return out


def recipe(row: Row) -> str:
    """The shipped recipe the row's overrides go on."""
    return RECIPES[row["model"]]


def refusal(row: Row) -> str | None:
    """The product's own answer: the one line `shardtune validate` prints for this row, or None."""
    try:
        resolved = load_recipe(recipe(row), [*BASE, *overrides(row)])
        check_world(resolved, row["world"])
    except UserError as e:
        return str(e)
    # validate's model checks (MoE: what LoRA on experts allows; sliding windows under context parallelism), on a
    # meta model: the same for every row with the same values of what they read
    key = (recipe(row), row["tuning"], row["objective"], row["backend"], row["context_parallel"])
    return _model_problem(key, resolved)


_MODEL_PROBLEMS: dict[tuple, str | None] = {}


def _model_problem(key: tuple, resolved) -> str | None:
    if key not in _MODEL_PROBLEMS:
        _MODEL_PROBLEMS[key] = next(iter(model_problems(resolved)), None)
    return _MODEL_PROBLEMS[key]


def row_id(row: Row) -> str:
    return "-".join(f"{v}" if not isinstance(v, bool) else (k if v else f"no_{k}") for k, v in row.items())


# Beside the pairs: the reproductions on our backend, each a row a user writes.
_DEFAULTS = {"precision": "fp32", "reduce_dtype": "fp32", "checkpointing": False, "vocab_parallel": True,
             "shard_adapter_states": True, "backend": "shardtune", "objective": "sft", "grad_accum": 1,
             "model": "dense", "long_context": "off", "rows": 1, "context_parallel": False}
EXTRA: list[Row] = [
    {"world": 4, "strategy": "hybrid_shard", **_DEFAULTS, "offload": True, "tuning": "full"},  # hybrid 2x2 + offload
    # FSDP2 + LoRA + DPO at one rank (llama-3.1-8b-dpo-lora-1x24gb engine.backend=torch): the first forward is the
    # reference one, with the adapters off; FSDP2 must still see them as trained (objective.adapters_disabled)
    {"world": 1, "strategy": "no_shard", **_DEFAULTS, "precision": "bf16", "backend": "torch", "objective": "dpo",
     "offload": False, "tuning": "lora"},
    # QLoRA on FSDP2 without offload (the array's two rows of the pair also offload)
    {"world": 2, "strategy": "full_shard", **_DEFAULTS, "precision": "bf16", "backend": "torch", "offload": False,
     "tuning": "qlora"},
    # GRPO with QLoRA on FSDP2 (the array's pairs hold grpo x qlora and grpo x torch apart): sampling and the
    # adapters-off reference forward on torchao's NF4 weights (MoE: validate refuses NF4 experts on FSDP2)
    {"world": 2, "strategy": "full_shard", **_DEFAULTS, "precision": "bf16", "backend": "torch", "objective": "grpo",
     "offload": False, "tuning": "qlora"},
]


# What validate refuses by design, as constraints: no row holds them, so each long-context value is still paired with
# every other value (with checkpointing on); each is asked of the product and its refusal asserted (test_matrix.py)
EXCLUDED = [("checkpointing", False, "long_context", value) for value in ("offload_activations", "both")]


@functools.cache
def covering_array() -> tuple[list[Row], list[tuple[Row, str]]]:
    # A row at world W starts W ranks: of equally covering rows the array keeps the one with fewer (64 candidates a
    # row: 22 rows starting 77 ranks; 32: 22 starting 87, 16: 22 starting 80; without the cost 86, 83, 82). 5 pairs
    # refused: EXCLUDED's 2 and context parallelism's 3 (without EXCLUDED, 45: offloaded activations, probed without
    # checkpointing, read as refused with most other values and never ran)
    rows, refused = all_pairs(FACTORS, refusal, tries=64, cost=lambda name, value: value if name == "world" else 0,
                              excluded=EXCLUDED)
    extra = [{n: r[n] for n in FACTORS} for r in EXTRA if {n: r[n] for n in FACTORS} not in rows]
    return rows + extra, refused


def known_failure(row: Row) -> str | None:
    """Rows that fail today on a defect not fixed yet (strict: the row fails the suite once it passes)."""
    return None


# -- inside the ranks ------------------------------------------------------------------------------------------------
def _build(out: Path, row: Row) -> T.Run:
    cache = out.parent / f"data-cache-{row['objective']}"  # one tokenized cache per data set for a start
    resolved = load_recipe(recipe(row), [f"train.output_dir={out}", f"data.cache_dir={cache}", *BASE,
                                         *overrides(row)])
    return T.setup(resolved, simulated=True)


def step_save_resume(row: Row, out: Path) -> None:
    run = _build(out, row)
    assert run.rt.device == accelerator.SIMULATED and run.rt.world_size == row["world"]
    # CUDA's caching allocator, modelled over the step's device storages; our engine reports its in-place resizes
    tracker = AllocatorTracker(recheck_min_bytes=recheck_min_bytes(resizes_reported=row["backend"] == "shardtune"))
    tracker.start()
    try:
        record = T.train_step(run, 0, tracker)
    finally:
        tracker.stop()
    assert record["step"] == 1, record
    if row["objective"] == "grpo":  # each prompt's 2 completions drawn, 2 tokens each (the simulated reads never stop)
        assert record["completions/mean_length"] == 2 and "reward" in record, record
        assert "kl" in record, record  # the reference's term: adapters off (LoRA), or the frozen copy (full)
    assert row["backend"] == "torch" or row["world"] == 1 or record["comm_bytes"] > 0, record  # FSDP2 counts none
    books = tracker.device  # blocks are rounded up and carved from segments; the step ends with a device sync
    assert books.peak_reserved >= books.peak_allocated >= tracker.peak_bytes() > 0, vars(books)
    assert books.held_back == 0, "a record_stream'd block outlived the step's closing sync"
    T.save_checkpoint(run, 1)
    assert (out / "checkpoints" / "step_1" / ".metadata").is_file()
    assert T.resume(run) == 1  # every rank reads its shards and optimizer state back (DCP, checked collectives)
    states_on_expected_devices(run)
    # The training loop's other collective: the memory maximum (a host number, on the host group: its value
    # survives, the device's reads would be zeros). The stop agreement rides on the step's all-reduce.
    assert host_max(float(run.rt.rank)) == run.rt.world_size - 1
    final = out / "final"  # the export: gathered to rank 0 (collective, checked), written as HF or a PEFT adapter
    save_final(run.sharded, run.model, run.tok, final, is_main=run.rt.is_main)
    dist.barrier(group=accelerator.host_group())
    written = load_file(next(final.glob("*.safetensors")))  # zeros: a meta tensor holds no values
    want = {n: s["shape"] for n, s in run.shapes.items()} if row["tuning"] == "full" else None
    assert written and (want is None or {n: list(t.shape) for n, t in written.items()} == want), sorted(written)
    # generate: the demo eval's greedy decoding, ranks in lockstep (every forward's collectives checked); the
    # simulated GPU's reads never say EOS, so it runs its whole budget and stops there
    assert exact_match(run.model, run.tok, [{"prompt": "abc", "response": "cba"}], run.rt, max_new_tokens=2) == 0.0


def states_on_expected_devices(run: T.Run) -> None:
    """Sharded states where the recipe puts them: the simulated GPU, or the host under offload of full fine-tuning
    (adapters stay on the device); AdamW's step where its kernel reads it (accelerator.step_tensor)."""
    if run.recipe.engine.backend == "torch":
        fsdp2_states_where_expected(run)
        return
    on_host = run.recipe.engine.cpu_offload and not run.recipe.lora.enabled
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            assert p.device.type == ("cpu" if on_host else "meta"), p.device
            state = run.optimizer.state[p]
            assert state["exp_avg"].device == p.device
            assert state["step"].device.type == (p.device.type if group.get("fused") else "cpu")


def fsdp2_states_where_expected(run: T.Run) -> None:
    """FSDP2 under cpu_offload: every parameter's shard (adapters too), and its AdamW moments, on the host: the
    simulated host here (simulated/fsdp2_offload.py); else on the simulated GPU."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    on_host = run.recipe.engine.cpu_offload
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            state = run.optimizer.state[p]
            for t in (p, state["exp_avg"], state["exp_avg_sq"]):
                assert is_host(local(t)) == on_host and local(t).is_meta, (type(local(t)), local(t).device)
    # QLoRA: the frozen NF4 shards too, part by part (torchao's NF4Tensor holds its bytes in its parts)
    nf4 = [local(p) for p in run.model.parameters() if is_nf4(local(p))]
    assert bool(nf4) == (run.recipe.lora.quantize_base == "nf4")
    for t in nf4:
        for name in t.__tensor_flatten__()[0]:
            assert is_host(getattr(t, name)) == on_host, name


def run_rows(base: str, rows: list[Row], results: str) -> None:
    """Each row in turn on this rank; its outcome recorded whatever happens, then every rank in step again."""
    set_check_timeout(20.0)  # a rank that skips a collective: the others report it after 20 s, not a hang
    outcome: dict[str, str | None] = {}
    for row in rows:
        torch.manual_seed(0)
        accelerator.TRACE.clear()
        try:
            step_save_resume(row, Path(base) / row_id(row))
            outcome[row_id(row)] = None
        except Exception:
            outcome[row_id(row)] = traceback.format_exc()[-3000:]
        dist.barrier(group=accelerator.host_group())
        new_epoch()  # a row that failed part-way left the groups' sequences apart: start them over
    Path(results, f"rank{dist.get_rank()}.json").write_text(json.dumps(outcome))
