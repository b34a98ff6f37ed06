"""Property test: hundreds of generated invalid recipes/overrides all exit 2 with one line, never a traceback."""
from __future__ import annotations

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtune.config.load import recipe_keys
from tests.unit.cli_helpers import run_cli

INT_MIN1 = ["train.micro_batch_size", "train.grad_accum", "train.max_steps", "train.log_every", "lora.r",
            "launch.nnodes"]
NON_NEG = ["train.warmup_steps", "train.eval_every", "train.save_every", "train.weight_decay",
           "train.max_grad_norm", "train.keep_last", "train.skip_nonfinite", "train.loss_chunk_tokens",
           "engine.nf4_tile_mb", "launch.max_restarts", "train.seed"]
CHOICES = {"engine.backend": ["shardtune", "torch"], "engine.strategy": ["full_shard", "shard_grad_op", "no_shard",
           "hybrid_shard"], "engine.mixed_precision": ["fp32", "bf16"], "engine.reduce_dtype": ["fp32", "bf16"],
           "data.format": ["text", "instruction", "chat"], "train.schedule": ["cosine", "linear", "constant"],
           "model.init": ["random", "pretrained"], "launch.device": ["auto", "cpu"]}
NUMERIC = INT_MIN1 + NON_NEG + ["train.lr", "data.seq_len", "lora.dropout", "train.seed"]
PATHS = ["model.config", "data.path", "model.tokenizer"]
ident = st.text(string.ascii_lowercase + "_", min_size=2, max_size=10)
junk = st.text(string.ascii_letters, min_size=1, max_size=8).filter(lambda s: s.lower() not in {"true", "false",
                                                                                                 "null", "none"})


@st.composite
def invalid_overrides(draw) -> tuple[list[str], str]:
    kind = draw(st.sampled_from(["unknown", "type", "range", "choice", "path", "hybrid", "not_kv"]))
    keys = set(recipe_keys())
    if kind == "unknown":
        section = draw(st.sampled_from(["model", "engine", "train", "data", "lora", "launch", "zz"]))
        key = f"{section}.{draw(ident)}"
        if key in keys:
            key += "_x"
        return [f"{key}=1"], key.split(".")[0] if section == "zz" else key
    if kind == "type":
        key = draw(st.sampled_from(NUMERIC))
        return [f"{key}={draw(junk)}"], key
    if kind == "range":
        key = draw(st.sampled_from(INT_MIN1 + NON_NEG))
        low = 0 if key in INT_MIN1 else -1
        return [f"{key}={draw(st.integers(min_value=-1000, max_value=low))}"], key
    if kind == "choice":
        key = draw(st.sampled_from(sorted(CHOICES)))
        value = draw(junk.filter(lambda v: v not in CHOICES[key]))
        extra = ["model.path=/nonexistent"] if key == "model.init" else []
        return [f"{key}={value}", *extra], "model.path" if extra else key
    if kind == "path":
        key = draw(st.sampled_from(PATHS))
        return [f"{key}=/nonexistent/{draw(ident)}.json"], key
    if kind == "hybrid":
        size = draw(st.integers(min_value=3, max_value=64))
        return ["engine.strategy=hybrid_shard", f"engine.hybrid_shard_size={size}"], "engine.hybrid_shard_size"
    return [draw(ident).replace("_", ".")], "KEY=VALUE"


@settings(max_examples=220, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=invalid_overrides())
def test_every_invalid_input_is_one_line_exit_2(case, capsys):
    overrides, mentions = case
    code, out, err = run_cli(["validate", "tiny-cpu", *overrides], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (overrides, out, err)
    assert len(lines) == 1 and "Traceback" not in err, (overrides, err)
    assert mentions in lines[0], (overrides, lines[0])


def test_yaml_cannot_run_code(tmp_path, capsys):
    """safe_load only: a python tag is a YAML error; a `_target_`-style component key is an unknown key."""
    evil = tmp_path / "evil.yaml"
    evil.write_text('model: !!python/object/apply:os.system ["touch pwned"]\n')
    code, _, err = run_cli(["validate", str(evil)], capsys)
    assert code == 2 and "not valid YAML" in err and not (tmp_path / "pwned").exists()
    target = tmp_path / "target.yaml"
    target.write_text("train:\n  _target_: os.system\n")
    code, _, err = run_cli(["validate", str(target)], capsys)
    assert code == 2 and "unknown recipe key" in err
