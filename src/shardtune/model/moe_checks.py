"""What `lora.target_modules` names in a model: Linear modules (peft's rule: the module name's last part) and fused
expert weights (`experts` = all of them; `gate_up_proj` / `up_proj` / `down_proj` also name the expert weight of
that name). `auto` = the attention's q_proj and v_proj, plus every expert weight when the model has experts.
A target that matches nothing, and any MoE setting we do not support, is a user error in one line, said by
`validate` (on a meta model) and again before anything is sharded (parallelize)."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from shardtune.model.attention import sliding_window
from shardtune.model.experts import EXPERTS_TARGET, expert_modules, expert_weights

AUTO = "auto"
AUTO_LINEAR = ("q_proj", "v_proj")
ROUTERS = ("gate", "router")  # MoE routers are not Linear modules in transformers 5: no adapters on them yet


@dataclass
class Targets:
    linear: list[str] = field(default_factory=list)  # peft target_modules
    expert_weights: list[str] = field(default_factory=list)  # fused expert weights adapted (peft target_parameters)
    missing: list[str] = field(default_factory=list)  # targets that match nothing
    has_experts: bool = False
    routers: list[str] = field(default_factory=list)  # targets naming a router (refused)

    def problem(self) -> str:
        if self.routers:
            return (f"lora.target_modules: {self.routers} name the MoE router, which takes no adapters here (a "
                    "router's weight is trained only with full fine-tuning): remove it")
        return (f"lora.target_modules: {self.missing} match no module of this model: name Linear modules "
                f"(e.g. q_proj, v_proj){', or experts' if self.has_experts else ''}, or use [auto]")


def resolve_targets(model: nn.Module, targets: list[str]) -> Targets:
    experts = expert_modules(model)
    weights = [w for _, m in experts for w in expert_weights(m)]
    linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    router_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                    if n.rsplit(".", 1)[-1] in ROUTERS and not isinstance(m, nn.Linear) and hasattr(m, "top_k")}
    out = Targets(has_experts=bool(experts))
    wanted = [*AUTO_LINEAR, EXPERTS_TARGET] if list(targets) == [AUTO] else list(targets)
    for t in wanted:
        matched = False
        if t in linear_names:
            out.linear.append(t)
            matched = True
        if t == EXPERTS_TARGET or t in weights:
            out.expert_weights += [w for w in dict.fromkeys(weights) if (t == EXPERTS_TARGET or w == t)
                                   and w not in out.expert_weights]
            matched = matched or bool(weights)
        if t in router_names:
            out.routers.append(t)
        elif not matched and not (t == EXPERTS_TARGET and list(targets) == [AUTO]):
            out.missing.append(t)
    out.expert_weights = [w for w in dict.fromkeys(weights) if w in out.expert_weights]  # forward order
    if out.routers:
        out.missing += out.routers
    return out


def moe_problems(recipe, model: nn.Module) -> list[str]:  # recipe: Recipe
    """The settings this model cannot take, one line each: unmatched LoRA targets, what experts do not support, a
    sliding window under engine.context_parallel."""
    lora, coef = recipe.lora, recipe.train.router_aux_loss_coef
    problems = []
    window = sliding_window(model.config) if recipe.engine.context_parallel else None
    if window:
        problems.append(f"engine.context_parallel: {model.config.model_type} has sliding-window attention (window "
                        f"{window}), which context parallelism does not split; set engine.context_parallel=false "
                        "(engine.offload_activations and engine.mlp_chunk_tokens cut long-context memory on one rank)")
    if coef and not expert_modules(model):
        problems.append(f"train.router_aux_loss_coef={coef}: the model has no experts (no router to balance); set 0")
    elif coef and recipe.train.objective != "sft":
        problems.append(f"train.router_aux_loss_coef={coef}: the balance loss is added to the sft objective only; "
                        "set 0 with train.objective=dpo")
    if not lora.enabled:
        return problems
    targets = resolve_targets(model, lora.target_modules)
    problems += [targets.problem()] if targets.missing else []
    if targets.expert_weights and lora.dropout:
        problems.append(f"lora.dropout={lora.dropout}: expert adapters take no dropout (one matmul per expert group "
                        "cannot drop per token and adapter); set lora.dropout=0 or leave experts out of "
                        "lora.target_modules")
    if targets.expert_weights and recipe.train.objective == "dpo":
        problems.append("train.objective=dpo with LoRA on experts: DPO's reference (adapters off) cannot switch "
                        "expert adapters off yet; leave experts out of lora.target_modules (e.g. [q_proj, v_proj])")
    if targets.has_experts and lora.quantize_base == "nf4" and recipe.engine.backend == "torch":
        problems.append("lora.quantize_base=nf4 with engine.backend=torch: FSDP2 + torchao have no NF4 fused "
                        "experts; use engine.backend=shardtune")
    return problems


def model_problems(recipe) -> list[str]:  # recipe: Recipe
    """`validate`'s check, on a meta model (no weights)."""
    if not (recipe.lora.enabled or recipe.train.router_aux_loss_coef or recipe.engine.context_parallel):
        return []
    from transformers import AutoModelForCausalLM

    from shardtune.model.build import load_config
    from shardtune.model.loading import build_empty

    return moe_problems(recipe, build_empty(lambda: AutoModelForCausalLM.from_config(load_config(recipe.model))))
