"""A PEFT adapter folder's expert adapters (peft's target_parameters layout, what final/ holds) read back to ours
(experts.expert_tensors_from_peft, what `export --merge` of final/ merges): exactly the tensors saved, on every tiny
MoE (gpt-oss stores its experts transposed); the Linears' adapters pass through under their peft keys."""
from __future__ import annotations

import pytest
import torch

from shardtune.checkpoint.merge import _peft_tensors
from shardtune.config.schema import LoraConfig
from shardtune.model.experts import expert_modules, expert_tensors_from_peft
from shardtune.model.lora import apply_lora, is_adapter, lora_config, save_adapter
from tests.unit.test_moe_lora import MOE, build


@pytest.mark.parametrize("name", MOE)
def test_final_expert_adapters_read_back(name, tmp_path):
    model = apply_lora(build(name), LoraConfig(enabled=True, r=4, alpha=8, target_modules=["q_proj", "experts"]),
                       seed=3)
    g = torch.Generator().manual_seed(1)
    ours = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if is_adapter(n)}
    config = lora_config(model)
    save_adapter(ours, config, tmp_path)
    back = expert_tensors_from_peft(_peft_tensors(tmp_path), list(config.target_parameters),
                                    {n for n, _ in expert_modules(model)}, r=config.r)
    experts = {n: t for n, t in ours.items() if n.endswith((".lora_A", ".lora_B"))}
    assert len(experts) == 4 * model.config.num_hidden_layers  # gate_up and down, A and B, per layer
    assert {n: t for n, t in back.items() if n.endswith((".lora_A", ".lora_B"))}.keys() == experts.keys()
    for n, t in experts.items():
        assert torch.equal(back[n], t), n
    linear = {n for n in back if n not in experts}
    assert linear and all(".q_proj.lora_" in n and n.endswith(".weight") for n in linear)
