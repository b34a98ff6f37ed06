"""Mixture of experts through the real CLI (the bundled tiny-moe-cpu recipe, a tiny Qwen3-MoE on 2 CPU workers):
- it learns the demo task as shipped (full fine-tuning): held-out exact match >= 90 %;
- LoRA on attention and every expert: `final/` is a PEFT adapter (target_parameters) that loads with
  PeftModel.from_pretrained, `export --merge` (from the checkpoint, and from final/) equals base + adapters to 1e-5,
  and `generate` runs on the merge.
Both train on forked ranks (forked.py: the launcher's checks and the worker, without the CLI's start-up; the CLI's
own behaviour is tested on the dense recipes), the learning run on one rank with the recipe's global batch (its 2
ranks' parity: tests/distributed/test_moe.py); export and generate run through the CLI."""
from __future__ import annotations

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardtune.config.load import load_recipe
from shardtune.model.build import build_model
from tests.integration import forked
from tests.integration.runs import FAST, forked_cli, summary

RECIPE = "tiny-moe-cpu"


def test_moe_learns_the_demo_task(tmp_path):
    run_dir = tmp_path / "run"
    run = forked.train_on_one_rank(RECIPE, f"train.output_dir={run_dir}", "train.eval_every=0", "train.save_final=false")
    assert run.code == 0, run.err[-3000:]
    result = summary(run_dir)
    assert result["accuracy_before"] <= 0.02 and result["accuracy_after"] >= 0.9, (result, run.out[-1500:])


def test_moe_lora_exports_merge_and_generates(tmp_path):
    run_dir = tmp_path / "run"
    run = forked.train(RECIPE, f"train.output_dir={run_dir}", "lora.enabled=true", "train.save_every=6", *FAST,
                       "train.lr=2e-2")
    assert run.code == 0, run.err[-3000:]
    recipe = load_recipe(run_dir / "recipe.yaml")
    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    base = build_model(recipe.model, seed=recipe.train.seed).eval()
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, str(run_dir / "final")).eval()(input_ids=ids).logits
    assert not torch.allclose(adapted, before, atol=1e-4)  # the expert and attention adapters trained
    out = tmp_path / "merged"
    proc = forked_cli("export", str(run_dir / "checkpoints"), str(out), "--merge", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    # final/ holds the same adapters in peft's target_parameters layout: read back, the same merged weights
    from_final = tmp_path / "merged-final"
    proc = forked_cli("export", str(run_dir / "final"), str(from_final), "--merge", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (load_file(str(d / "model.safetensors")) for d in (out, from_final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("mlp.experts.down_proj") for k in a)  # the fused experts are in the merge
    proc = forked_cli("generate", str(from_final), "--prompt", "reverse abc=", "--prompt", "reverse hello=", "--max-new-tokens",
               "6", cwd=tmp_path)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 2, proc.stderr[-3000:]
