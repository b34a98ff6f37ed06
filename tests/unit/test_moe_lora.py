"""LoRA on fused expert weights (model/experts.py, model/moe_checks.py), in process: the grouped forward equals transformers'
own experts forward; adapters follow peft's per-expert LoRA exactly (a saved adapter loads with
PeftModel.from_pretrained and gives our logits, and peft's merge gives the same model); targets resolve to what the
model has, and a target matching nothing is a user error."""
from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.bundled import CONFIGS_DIR
from shardtune.config.schema import LoraConfig
from shardtune.errors import UserError
from shardtune.model.experts import expert_modules, use_grouped_experts
from shardtune.model.lora import apply_lora, is_adapter, lora_config, save_adapter
from shardtune.model.moe_checks import resolve_targets

MOE = ("tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss")


def build(name: str, seed: int = 0):
    cfg = AutoConfig.from_pretrained(str(CONFIGS_DIR / "models" / f"{name}.json"))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def ids() -> torch.Tensor:
    return torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", MOE)
def test_grouped_forward_equals_transformers(name):
    model = build(name)
    with torch.no_grad():
        ref = model(input_ids=ids()).logits
        use_grouped_experts(model)
        got = model(input_ids=ids()).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MOE)
def test_expert_adapters_load_in_peft(name, tmp_path):
    model = apply_lora(build(name), LoraConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "experts"]),
                       seed=3)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    assert any(".experts.lora_down_proj." in n for n in adapters) and all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for n, p in model.named_parameters() if not is_adapter(n))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapters.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B is zero at init: make every adapter count
        ours = model(input_ids=ids()).logits
        base = build(name)(input_ids=ids()).logits
    assert not torch.allclose(ours, base, atol=1e-3)
    save_adapter({n: p.detach() for n, p in adapters.items()}, lora_config(model), tmp_path)
    loaded = PeftModel.from_pretrained(build(name), str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids()).logits, ours, rtol=1e-4, atol=1e-5)
        merged = loaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids()).logits, ours, rtol=1e-4, atol=1e-5)


def test_experts_only_targets_and_auto():
    model = build("tiny-qwen3-moe")
    auto = resolve_targets(model, ["auto"])
    assert auto.linear == ["q_proj", "v_proj"] and auto.expert_weights == ["gate_up_proj", "down_proj"]
    dense = resolve_targets(build("tiny-mixtral"), ["down_proj"])  # Mixtral has no Linear down_proj: the experts'
    assert dense.linear == [] and dense.expert_weights == ["down_proj"] and not dense.missing
    apply_lora(model, LoraConfig(enabled=True, r=2, alpha=4, target_modules=["experts"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".experts.lora_" in n for n in trainable)
    assert len(expert_modules(model)) == 2


@pytest.mark.parametrize("targets, words", [(["gate_proj"], "['gate_proj'] match no module"),
                                            (["q_proj", "gate"], "router")])
def test_unmatched_target_is_a_user_error(targets, words):
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
        apply_lora(build("tiny-qwen3-moe"), LoraConfig(enabled=True, r=2, target_modules=targets))


@pytest.mark.parametrize("name", MOE)
def test_router_balance_is_transformers_loss_per_row(name):
    """One row: our per-row balance loss (per token, / seq) is transformers' load_balancing_loss_func / top_k, layer by
    layer; two rows: the sum of each row's own loss (what makes it exact under any split of the rows)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from shardtune.model.router_loss import RouterBalance

    model = build(name)
    balance = RouterBalance(model)
    x = ids()
    seq = x.shape[1]
    per_row = []
    for row in x:
        balance.start()
        model(input_ids=row[None])
        layers = balance.recorded()
        ours = balance.loss(1, seq)
        theirs = [load_balancing_loss_func((logits,), logits.shape[-1], idx.shape[-1]) / idx.shape[-1]
                  for logits, idx in layers]
        torch.testing.assert_close(ours, sum(theirs) / len(theirs), rtol=1e-5, atol=1e-6)
        per_row.append(ours)
    balance.start()
    model(input_ids=x)
    torch.testing.assert_close(balance.loss(x.shape[0], seq), sum(per_row), rtol=1e-5, atol=1e-6)
