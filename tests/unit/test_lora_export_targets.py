"""Whatever LoRA targets validate accepts, the adapter is written and loads back in peft with the same logits, on
every tiny model config and on a Qwen2-MoE (experts plus a shared expert whose Linears are named gate_proj, up_proj
and down_proj, like the experts' own weights). The case that trained and then failed to save final/ (issue 59,
item 4): the tiny-lora-cpu recipe's targets on a MoE, where `down_proj` names both the shared expert's Linear and
the experts' fused weight, and every expert weight was adapted although only down_proj was a target parameter."""
from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.bundled import CONFIGS_DIR
from shardtune.config.schema import LoraConfig
from shardtune.errors import UserError
from shardtune.model.lora import apply_lora, check_exportable, is_adapter, lora_config, save_adapter
from shardtune.model.moe_checks import resolve_targets

CONFIGS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss", "qwen2-moe")
TARGETS = (["auto"], ["q_proj", "v_proj"],
           ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # tiny-lora-cpu's
           ["q_proj", "v_proj", "gate_proj", "up_proj"], ["down_proj"], ["gate_up_proj"], ["q_proj", "experts"],
           ["experts", "down_proj"])


def build(name: str):
    if name == "qwen2-moe":  # no bundled config: the smallest Qwen2-MoE with a shared expert
        cfg = AutoConfig.for_model("qwen2_moe", vocab_size=128, hidden_size=32, intermediate_size=64,
                                   moe_intermediate_size=16, shared_expert_intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=64)
    else:
        cfg = AutoConfig.from_pretrained(str(CONFIGS_DIR / "models" / f"{name}.json"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_every_accepted_target_list_saves_and_loads_back_in_peft(name, tmp_path):
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    for targets in TARGETS:
        cfg = LoraConfig(enabled=True, r=2, alpha=4, target_modules=targets)
        if resolve_targets(build(name), targets).missing:  # validate refuses these: so does training
            with pytest.raises(UserError, match="match no module"):
                apply_lora(build(name), cfg)
            continue
        model = apply_lora(build(name), cfg, seed=1)
        adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in adapters.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B is zero at init: make every adapter count
            ours = model(input_ids=ids).logits
        out = tmp_path / "-".join(targets)
        save_adapter({n: p.detach() for n, p in adapters.items()}, lora_config(model), out)
        loaded = PeftModel.from_pretrained(build(name), str(out)).eval()
        assert sum(is_adapter(n) for n, _ in loaded.named_parameters()) == len(adapters), targets
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, ours, rtol=1e-4, atol=1e-5, msg=str(targets))


def test_only_the_targeted_expert_weights_get_adapters():
    model = apply_lora(build("qwen2-moe"), LoraConfig(enabled=True, r=2, alpha=4, target_modules=["down_proj"]))
    names = [n for n, _ in model.named_parameters() if is_adapter(n)]
    assert any(".experts.lora_down_proj." in n for n in names)
    assert any(".shared_expert.down_proj.lora_A." in n for n in names)
    assert not any("gate_up_proj" in n for n in names)  # not a target: no adapter, frozen
    assert lora_config(model).target_parameters == ["down_proj"]


def test_an_adapter_that_cannot_be_exported_fails_before_training():
    """The start-of-run check (apply_lora calls it): an expert adapter on a weight the config does not name."""
    model = apply_lora(build("tiny-qwen3-moe"), LoraConfig(enabled=True, r=2, alpha=4, target_modules=["experts"]))
    config = lora_config(model)
    config.target_parameters = ["down_proj"]
    with pytest.raises(ValueError, match="'gate_up_proj' is not in list"):
        check_exportable(model, config)


def test_validate_rehearses_the_export(monkeypatch):
    """validate injects the adapters on a meta model (lora.rehearse_lora), so the export rehearsal runs before any
    training: a failure there stops `validate`, not the end of a run."""
    from shardtune.config.load import load_recipe
    from shardtune.launcher.validate import recipe_problems
    from shardtune.model import lora

    recipe = load_recipe("tiny-moe-cpu", ["lora.enabled=true", "lora.target_modules=[q_proj,down_proj]"])
    seen = []
    monkeypatch.setattr(lora, "check_exportable", lambda model, config: seen.append(config.target_parameters))
    assert recipe_problems(recipe) == []
    assert seen == [["down_proj"]]
