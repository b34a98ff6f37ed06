"""LoRA with every memory feature on (the bundled tiny-lora-cpu recipe: LoRA + bf16 + activation checkpointing + CPU
offload, 2 CPU workers): trains, checkpoints adapters + optimizer only, resumes exactly, and `final/` and `shardtune
export` are PEFT adapters that load with PeftModel.from_pretrained. Every run trains on forked ranks (forked.py: the
launcher's checks and the worker, without the CLI's start-up; what the executable and torchrun add is
test_cli_train's and test_checkpoint's); export and generate run the CLI's main forked (runs.py forked_cli), but
export's refusal to overwrite runs through the executable."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from transformers import AutoModelForCausalLM

from shardtune.config.load import load_recipe
from shardtune.model.build import build_model
from tests.integration import forked
from tests.integration.runs import FAST, cli, forked_cli, losses


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"train.output_dir={run_dir}", "train.save_every=3", *FAST, *extra]



@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora") / "reference"
    run = forked.train("tiny-lora-cpu", *overrides(run_dir))  # 2 forked ranks: the launcher's checks and the worker
    assert run.code == 0, run.err[-3000:]
    return run_dir


def base_model():
    recipe = load_recipe("tiny-lora-cpu")
    return build_model(recipe.model, seed=recipe.train.seed).eval()


def test_lora_checkpoint_holds_adapters_and_optimizer_only(reference):
    keys = set(dcp.FileSystemReader(str(reference / "checkpoints" / "step_6")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith(("model.", "replicated."))}
    assert model_keys and all(k.startswith("replicated.") and ".lora_" in k for k in model_keys), sorted(keys)[:5]
    assert any(k.startswith("replicated_optim.") and k.endswith(".exp_avg") for k in keys)


def test_lora_resume_is_exact(reference, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    (run_dir / "checkpoints" / "latest").write_text("step_3")
    run = forked.train("tiny-lora-cpu", *overrides(run_dir))
    assert run.code == 0, run.err[-3000:]
    assert "resumed from" in run.out
    assert losses(run_dir) == {s: v for s, v in losses(reference).items() if s > 3}


def test_lora_export_and_final_are_peft_adapters(reference, tmp_path):
    out = tmp_path / "export"
    proc = forked_cli("export", str(reference / "checkpoints"), str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a random-init base is on no disk: the export says so, and what generate will need
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warning) == 1 and "names no base model" in warning[0] and "--base" in warning[0], proc.stderr
    for folder in (out, reference / "final"):
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        # a random-init base exists on no disk: the adapter names none (not the architecture's config.json)
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = base_model()(input_ids=ids).logits
        exported = PeftModel.from_pretrained(base_model(), str(out)).eval()(input_ids=ids).logits
        final = PeftModel.from_pretrained(base_model(), str(reference / "final")).eval()(input_ids=ids).logits
    torch.testing.assert_close(exported, final, rtol=0, atol=0)  # the same adapters, step 6
    assert not torch.allclose(exported, base)  # and they changed the model


def test_generate_loads_an_exported_adapter_on_its_base(reference, tmp_path):
    """An exported adapter away from its run (no recipe.yaml above it) loads on the local folder its
    adapter_config.json names, or on --base, and answers as the run's own final/ does; one that names no base (a
    random-init run) or a base that is no local folder is one line saying how to pass it."""
    out = tmp_path / "export"
    assert forked_cli("export", str(reference / "checkpoints"), str(out), cwd=tmp_path).returncode == 0
    base = tmp_path / "base"
    base_model().save_pretrained(base)
    prompts = ["--prompt", "reverse abc=", "--prompt", "reverse hello=", "--max-new-tokens", "6"]
    want = forked_cli("generate", str(reference / "final"), *prompts, cwd=tmp_path)  # the base from the recipe
    assert want.returncode == 0 and len(want.stdout.splitlines()) == 2, want.stderr[-3000:]

    proc = cli("generate", str(out), *prompts, cwd=tmp_path)  # adapter_config.json: base_model_name_or_path null
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "names no base model" in proc.stderr and "--base MODEL_FOLDER" in proc.stderr
    got = forked_cli("generate", str(out), *prompts, "--base", str(base), cwd=tmp_path)
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr[-3000:]

    config = json.loads((out / "adapter_config.json").read_text())
    for named, code in ((str(base), 0), ("someone/tiny-llama", 2)):
        (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": named}))
        got = forked_cli("generate", str(out), *prompts, cwd=tmp_path)
        assert got.returncode == code, got.stderr[-3000:]
        if code == 0:
            assert got.stdout == want.stdout
        else:
            assert got.stderr.count("\n") == 1 and "'someone/tiny-llama'" in got.stderr and "--base" in got.stderr
    proc = forked_cli("generate", str(out), *prompts, "--base", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert proc.returncode == 2 and "--base" in proc.stderr and "no config.json" in proc.stderr, proc.stderr


def test_lora_over_pretrained_checkpoint_loads_sharded(tmp_path):
    """model.init=pretrained: the base is built on meta and each rank reads its shards from the files (a
    multi-file checkpoint with an index); peft's adapters, created on meta too, get a real seeded init."""
    base = base_model()
    base.save_pretrained(tmp_path / "pre", max_shard_size="300KB")
    run_dir = tmp_path / "run"
    run = forked.train("tiny-lora-cpu", *overrides(run_dir, "model.init=pretrained", f"model.path={tmp_path / 'pre'}",
                                                   "model.config=null", "train.max_steps=2"))
    assert run.code == 0, run.err[-3000:]
    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tuned = PeftModel.from_pretrained(base, str(run_dir / "final")).eval()(input_ids=ids).logits
    assert torch.isfinite(tuned).all() and all(math.isfinite(v) for v in losses(run_dir).values())
    # --merge over a pretrained base streams its weights from the base's files (several, with an index)
    proc = forked_cli("export", str(run_dir / "checkpoints"), str(tmp_path / "merged"), "--merge", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, tuned, rtol=0, atol=1e-5)
    # the adapter names its real base (the folder it was trained over), and --merge takes the run's final/ too
    adapter_config = json.loads((run_dir / "final" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tmp_path / "pre")
    proc = forked_cli("export", str(run_dir / "final"), str(tmp_path / "merged-final"), "--merge", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        from_final = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-final").eval()(input_ids=ids).logits
    torch.testing.assert_close(from_final, merged, rtol=0, atol=0)


def test_export_merge_is_base_plus_adapter(reference, tmp_path):
    """--merge: full HF safetensors (split in files here, to test the streaming writer's index) that load with
    from_pretrained alone and give the logits of the base with the adapter applied."""
    out = tmp_path / "merged"
    proc = forked_cli("export", str(reference / "checkpoints"), str(out), "--merge", "--max-shard-size-mb", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "generation_config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert not (out / "adapter_config.json").exists()
    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base_model(), str(reference / "final")).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)


def test_export_never_overwrites_without_force(reference, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the base model the run started from")
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = forked_cli("export", str(reference / "checkpoints"), str(out), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--force" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    proc = forked_cli("export", str(reference / "checkpoints"), str(out), "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file() and (out / "notes.txt").read_text() == "mine"
    assert not (out / "model.safetensors").exists()  # no stale model file beside the adapter


def test_generate_on_an_adapter_and_a_checkpoint(reference, tmp_path):
    """`generate` on final/ (a PEFT adapter: the base is rebuilt from the run's seed) and on the step-6 checkpoint
    (consolidated first) samples what the base with the adapter merged samples, decoded here by hand with the same
    seed (6 steps have not taught it to answer: greedy would stop at once on EOS), with no warning on stderr."""
    from shardtune.model.build import build_tokenizer
    from shardtune.templates import render_prompt

    prompts = ["reverse abcd=", "reverse hello="]
    recipe = load_recipe(reference / "recipe.yaml")
    tok = build_tokenizer(recipe.model)
    model = PeftModel.from_pretrained(base_model(), str(reference / "final")).merge_and_unload().eval()
    expected = []
    for p in prompts:
        ids = tok((tok.bos_token or "") + render_prompt(recipe.data.template, p), return_tensors="pt",
                  add_special_tokens=False)["input_ids"]
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=None, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
        expected.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert any(expected), expected  # something to compare
    for target in (reference / "final", reference / "checkpoints" / "step_6"):
        proc = forked_cli("generate", str(target), *(a for p in prompts for a in ("--prompt", p)), "--max-new-tokens", "6",
                   "--temperature", "1", "--seed", "0", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines() == expected, (target, proc.stdout, expected)
        assert "warning" not in proc.stderr, proc.stderr


def test_sharded_adapter_states_resume_on_one_worker(tmp_path):
    """engine.shard_adapter_states (the default): each of 2 workers steps and saves the AdamW state of its own half of
    the adapters. The checkpoint holds every adapter's state, and 1 worker (micro-batch doubled: the same global
    batch) resumes from it with the 2-worker run's losses (fp32 compute, so the two worlds agree to 1e-5)."""
    run_dir = tmp_path / "two"
    fp32 = ("engine.mixed_precision=fp32", "engine.shard_adapter_states=true")
    run = forked.train("tiny-lora-cpu", *overrides(run_dir, *fp32))
    assert run.code == 0, run.err[-3000:]
    keys = set(dcp.FileSystemReader(str(run_dir / "checkpoints" / "step_3")).read_metadata().state_dict_metadata)
    adapters = {k.removeprefix("replicated.") for k in keys if k.startswith("replicated.")}
    assert len(adapters) == 4 * 7 * 2  # lora_A and lora_B of 7 projections in each of tiny-llama's 4 blocks
    for state in ("exp_avg", "exp_avg_sq"):
        assert {a for a in adapters if f"replicated_optim.{a}.{state}" in keys} == adapters, state
    one = tmp_path / "one"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step_3", one / "checkpoints" / "step_3")
    (one / "checkpoints" / "latest").write_text("step_3")
    run = forked.train("tiny-lora-cpu", *overrides(one, *fp32, "train.micro_batch_size=16"), world=1)
    assert run.code == 0 and "resumed from" in run.out, run.err[-3000:]
    got, ref = losses(one), {s: v for s, v in losses(run_dir).items() if s > 3}
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
