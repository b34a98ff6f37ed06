"""Every collective in src/ either gets tensors on the runtime's device (what NCCL needs; on the simulated GPU
the fake group refuses anything else, so every simulated test checks it at run time) or goes through a gloo side
group on purpose (host objects: agreement flags, DCP's plans, the data cache's message). A new collective call
fails this test until it is put in one of the two tables, with its reason."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "shardtune"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "all_gather_object", "gather_object", "scatter_object_list", "barrier", "isend", "irecv", "send",
               "recv", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter"}

# (file, function) -> why its tensors are on the runtime's device.
ON_DEVICE = {
    ("engine/collectives.py", "all_gather_into"): "the engine's flat buffers (compute device)",
    ("engine/collectives.py", "reduce_scatter_into"): "the engine's flat gradients (compute device)",
    ("engine/collectives.py", "all_reduce_"): "flat gradients, adapter buckets, the squared norm (compute device)",
    ("engine/collectives.py", "_post"): "gloo only: the in-place ring runs when the backend is gloo",
    ("engine/collectives.py", "all_to_all_into"): "vocab-parallel logits and their gradient (compute device)",
    ("engine/torch_backend.py", "clip_grad_norm_"): "the squared norm, built with device=the model's device",
    ("model/fingerprint.py", "check_same_on_all_ranks"): "checksums built with device=runtime device",
    ("trainer/decode.py", "_first_all_ended"): "the counts of ended rows, summed from the decoded tokens (model's device)",
    ("trainer/evaluate.py", "eval_loss"): "the eval loss sum and target count, built with device=runtime device",
    ("trainer/objective.py", "_precompute"): "the DPO reference table, built with device=runtime device",
    ("trainer/objective.py", "_eval_on_device"): "the DPO eval statistics, built with device=runtime device",
    ("trainer/train.py", "train_step"): "the step's loss sum, built with device=runtime device",
}
# (file, function) -> the gloo group it passes on purpose.
ON_HOST_GROUP = {
    ("accelerator.py", "init_process_group"): "the host group it just made: no rank leaves before all connected",
    ("checkpoint/manager.py", "_agree_ok"): "accelerator.host_group()",
    ("checkpoint/manager.py", "_barrier"): "accelerator.host_group()",
    ("data/ranks.py", "prepare_for_ranks"): "dist.new_group(backend='gloo')",
    ("hub.py", "fetch_for_ranks"): "dist.new_group(backend='gloo'): rank 0's download message",
    ("engine/vocab.py", "max_tokens"): "accelerator.host_group(): a token count, host metadata",
    ("trainer/decode.py", "_agreed"): "accelerator.host_group(): token budgets and row counts, host numbers",
    ("trainer/grpo.py", "_gather_global"): "accelerator.host_group(): the step's rewards and lengths, host floats",
    ("trainer/grpo.py", "evaluate"): "accelerator.host_group(): the held-out reward sums, host floats",
    ("trainer/runtime.py", "host_max"): "accelerator.host_group(): a memory tracker's peak, a host number",
}


def _calls() -> list[tuple[str, str, str, ast.Call]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                        and node.func.attr in COLLECTIVES):
                    found.append((rel, fn.name, node.func.attr, node))
    return found


def test_every_collective_is_on_the_device_or_on_a_gloo_group():
    calls = _calls()
    assert len(calls) >= 12, "the scan found too few collectives: is SRC right?"
    unknown = [(f, fn, op) for f, fn, op, _ in calls if (f, fn) not in ON_DEVICE and (f, fn) not in ON_HOST_GROUP]
    assert not unknown, f"collectives in neither table (add them, with the reason): {unknown}"


def test_host_group_collectives_pass_their_group():
    src = {p.relative_to(SRC).as_posix(): p.read_text() for p in SRC.rglob("*.py")}
    for f, fn, op, node in _calls():
        if (f, fn) not in ON_HOST_GROUP:
            continue
        group = next((k.value for k in node.keywords if k.arg in ("group", "process_group")), None)
        assert group is not None, f"{f}:{fn} dist.{op} has no group= (it would run on the default group)"
        text = ast.get_source_segment(src[f], group)
        assert "host_group" in text or _gloo_group_variable(src[f], fn, text), f"{f}:{fn}: group={text}"


def test_dcp_runs_on_the_host_group():
    text = (SRC / "checkpoint" / "manager.py").read_text()
    assert text.count("process_group=accelerator.host_group()") == 2  # dcp.save and dcp.load


def _gloo_group_variable(source: str, fn_name: str, name: str) -> bool:
    """`name` is assigned from dist.new_group(backend="gloo", ...) in function `fn_name`."""
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and fn.name == fn_name:
            for node in ast.walk(fn):
                if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
                        and isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", "") == "new_group"):
                    return any(k.arg == "backend" and getattr(k.value, "value", None) == "gloo"
                               for k in node.value.keywords)
    return False
