"""Mixture-of-experts layers: which modules hold experts, LoRA per expert on their fused 3-D weights, and the
grouped-matmul forward that computes base + adapters without a Python loop over experts.

transformers 5 stores a layer's experts as 3-D parameters of one module (`gate_up_proj` `[experts, 2·inter, hidden]`,
`down_proj` `[experts, hidden, inter]`; gpt-oss stores them transposed, `[experts, in, out]`, with biases), and
dispatches the module's forward through `ALL_EXPERTS_FUNCTIONS` by `config._experts_implementation`. We register
our forward there (`shardtune`), a public extension point, and select it with `set_experts_implementation`.

Why our own adapters rather than peft's `target_parameters`: peft adapts a 3-D parameter by re-parametrizing it for
each forward (`torch.nn.utils.parametrize`), materialising W + s·B·A for every expert, a second copy of the layer's
experts that the matmul then saves for backward (~1.2 GB per layer of Qwen3-30B-A3B in bf16), and it needs the
parameter to stay registered where our engine binds gathered views (and NF4 bytes) as plain attributes. Here each
projection computes `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` per expert with grouped matmuls: the adapters' extra memory is the (tokens,
r) intermediate. The adapters are peft's per-expert LoRA exactly (A `[experts, r, in]`, B `[experts, out, r]`,
peft's initialisation), and `peft_expert_tensors` writes them in peft's `target_parameters` layout, so an export
loads with `PeftModel.from_pretrained` and merges to the same weights.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune import accelerator

ADAPTER = "default"  # peft's adapter name (model/lora.py): it marks a parameter as an adapter (replicated by the engine)
EXPERTS_TARGET = "experts"  # lora.target_modules entry: every expert weight of every MoE layer
WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")  # fused expert weights transformers 5 names, in forward order
IMPLEMENTATION = "shardtune"


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module (`@use_experts_implementation`): fused 3-D weights, routed per token."""
    return hasattr(module, "is_transposed") and hasattr(module, "num_experts") and bool(expert_weights(module))


def expert_weights(module: nn.Module) -> list[str]:
    return [w for w in WEIGHTS if isinstance(getattr(module, w, None), torch.Tensor) and getattr(module, w).ndim == 3]


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_experts(m)]


def in_out(module: nn.Module, weight: str) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of one fused weight, whatever its storage order."""
    e, a, b = getattr(module, weight).shape
    return (e, a, b) if module.is_transposed else (e, b, a)


class ExpertLora(nn.Module):
    """LoRA on one fused expert weight: expert e adds s·B[e]·A[e] to its (out x in) matrix."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, r: int, alpha: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(num_experts, r, in_features))  # 3-D, fp32: x -> r per expert
        self.lora_B = nn.Parameter(torch.zeros(num_experts, out_features, r))  # 3-D, fp32: zero, so W is unchanged
        self.scale = alpha / r

    def reset(self, generator: torch.Generator) -> None:
        # peft's init of lora_A (kaiming_uniform, a=sqrt(5), on an (r·E x in) Linear): U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(self.lora_A.shape[-1])
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
            self.lora_B.zero_()


def apply_expert_lora(model: nn.Module, *, weights: list[str], r: int, alpha: float, seed: int) -> list[str]:
    """Add adapters to the expert weights named in `weights` (frozen base); returns the weight names adapted (peft
    target_parameters). Only those: the export writes one peft wrapper per name of target_parameters, so an adapter
    on a weight not named there could not be saved. Drawn on the host from `seed`, in module order: the same on
    every rank, whether the base is real or on meta."""
    generator = torch.Generator().manual_seed(seed)
    adapted: list[str] = []
    for _, m in expert_modules(model):
        for w in (w for w in expert_weights(m) if w in weights):
            e, fan_in, fan_out = in_out(m, w)
            lora = ExpertLora(e, fan_in, fan_out, r=r, alpha=alpha)
            lora.reset(generator)
            m.add_module(f"lora_{w}", nn.ModuleDict({ADAPTER: lora}))
            getattr(m, w).requires_grad_(False)
            adapted += [w] if w not in adapted else []
    return adapted


def register_experts_implementation() -> str:
    """Make `experts_forward` selectable as transformers' experts implementation `shardtune` (once per process)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    return IMPLEMENTATION


def use_grouped_experts(model: nn.Module) -> None:
    """Route every experts module of `model` through `experts_forward`."""
    model.set_experts_implementation(register_experts_implementation())


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of (tokens, hidden) inputs, each token through its top-k experts, as grouped matmuls: the
    token-expert pairs sorted by expert, one matmul per projection over all experts (offsets mark each expert's rows)."""
    num_tokens, hidden = hidden_states.shape
    k = top_k_index.size(-1)
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)  # (S,) S = tokens·k pairs, grouped by expert
    offsets = routed_offsets(ids, self.num_experts)
    x = hidden_states[perm // k]
    first = "gate_up_proj" if self.has_gate else "up_proj"
    h = project(self, first, x, offsets, ids)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = project(self, "down_proj", h, offsets, ids)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    # back to token-major order (tokens, k, hidden) by a gather: no zero-filled (S, hidden) buffer in forward
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    y = y[inverse]
    return y.view(num_tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (S, in) rows sorted by expert @ w (E, in, out) per expert. torch's grouped kernel needs 16-byte aligned
    strides (a rank-4 bf16 adapter's rows are 8 bytes) and, on an accelerator, bf16; otherwise transformers'
    per-expert fallback op (a loop with one host read). Inside a compiled block: `grouped_mm_op`, one graph node
    running this function."""
    if torch.compiler.is_compiling():
        return grouped_mm_op(x, w, offsets)
    if torch_grouped_kernel(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    from transformers.integrations import moe  # registers torch.ops.transformers.grouped_mm_fallback

    assert moe is not None
    return torch.ops.transformers.grouped_mm_fallback(x, w, offsets)


def torch_grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w)` runs torch's grouped kernel (else transformers' fallback loop)."""
    # forward and both gradients: every dim of both matrices (in, out, the adapters' r) a multiple of 16 bytes
    aligned = x.stride(-1) == 1 and all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], *w.shape[-2:]))
    return aligned and (x.dtype == torch.bfloat16 or not accelerator.is_accelerator(x.device))


def routed_offsets(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int32 cumulative routed rows per expert of the expert-sorted `ids`: how many ids are <= e, found on the
    device. Not bincount: CUDA's reads the ids' maximum on the host (a sync per MoE layer per micro-batch)."""
    experts = torch.arange(num_experts, device=ids.device, dtype=ids.dtype)
    return torch.searchsorted(ids, experts, right=True, out_int32=True)


def project(self: nn.Module, weight: str, x: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One fused projection of expert-sorted rows: base (a tensor or NF4 experts) + bias + adapters."""
    w = getattr(self, weight)
    if hasattr(w, "grouped_linear"):  # NF4 experts (engine/nf4_experts.py): dequantized per group of experts
        y = w.grouped_linear(x, offsets)  # blocks along the input dim whatever the storage order
    else:
        y = grouped_mm(x.to(w.dtype), w if self.is_transposed else w.transpose(-2, -1), offsets)
    bias = getattr(self, f"{weight}_bias", None)
    if bias is not None:
        y = y + bias[ids]
    lora = getattr(self, f"lora_{weight}", None)
    if lora is not None:
        # In the compute dtype, as autocast would (the fp32 adapters get their gradient through the cast): CUDA's
        # grouped kernel takes bf16 only, and a bf16 run's rows are bf16 already.
        a, dt = lora[ADAPTER], x.dtype
        xa = grouped_mm(x, a.lora_A.to(dt).transpose(-2, -1), offsets)  # (S, r)
        y = y + (a.scale * grouped_mm(xa, a.lora_B.to(dt).transpose(-2, -1), offsets)).to(y.dtype)
    return y


def peft_expert_tensors(prefix: str, weight: str, targets: list[str],
                        a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our (A, B) of `prefix`'s `weight` -> peft's saved keys and layouts for `target_parameters=targets`: peft nests
    one wrapper per targeted parameter (the first target innermost, under `base_layer.`), and keeps lora_A as an
    (r·E x in) Linear weight and lora_B as (out x r·E) with the experts fastest."""
    nesting = "base_layer." * (len(targets) - 1 - targets.index(weight))
    e, r, fan_in = a.shape
    return {f"{prefix}.{nesting}lora_A.weight": a.reshape(e * r, fan_in),
            f"{prefix}.{nesting}lora_B.weight": b.permute(1, 2, 0).reshape(b.shape[1], r * e)}


def expert_tensors_from_peft(tensors: dict[str, torch.Tensor], targets: list[str], experts: set[str], *,
                             r: int) -> dict[str, torch.Tensor]:
    """The inverse of `peft_expert_tensors`: a PEFT adapter file's tensors (keys without `base_model.model.`) ->
    ours for the expert adapters of the modules named in `experts` ({our parameter name: tensor}, the layout
    `merge_factors` takes); every other key (the Linears' adapters) unchanged."""
    out = {}
    for key, t in tensors.items():
        path, leaf = key[:-len(".lora_A.weight")], key[-len("lora_A.weight"):]
        depth = 0
        while path.endswith(".base_layer"):
            path, depth = path[:-len(".base_layer")], depth + 1
        if path not in experts or leaf not in ("lora_A.weight", "lora_B.weight"):
            out[key] = t
            continue
        name = f"{path}.lora_{targets[len(targets) - 1 - depth]}.{ADAPTER}.{leaf.removesuffix('.weight')}"
        if leaf == "lora_A.weight":  # (r·E, in) -> (E, r, in)
            out[name] = t.reshape(-1, r, t.shape[-1])
        else:  # (out, r·E), experts fastest -> (E, out, r)
            out[name] = t.reshape(t.shape[0], r, -1).permute(2, 0, 1)
    return out


def merge_factors(adapters: dict[str, torch.Tensor], model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Expert adapters {our name: tensor} -> {base weight name: (a, b)} with b @ a the update in the weight's storage
    order (a batched matmul per expert): B·A for `[experts, out, in]`, (B·A)ᵀ = Aᵀ·Bᵀ for transposed storage.
    `model` (meta is enough) says which experts modules store their weights transposed."""
    transposed = {name for name, m in expert_modules(model) if m.is_transposed}
    out = {}
    for name, a in adapters.items():
        module, _, leaf = name.rpartition(f".{ADAPTER}.")
        if leaf != "lora_A":
            continue
        prefix, _, attr = module.rpartition(".")
        b = adapters[f"{module}.{ADAPTER}.lora_B"].float()
        a = a.float()
        out[f"{prefix}.{attr.removeprefix('lora_')}"] = ((b.transpose(-2, -1), a.transpose(-2, -1))
                                                         if prefix in transposed else (a, b))
    return out


# -- the compiled form: a torch.library custom op (what dynamo cannot trace; engine/compile.py) ------------


@torch.library.custom_op("shardtune::grouped_mm", mutates_args=())
def grouped_mm_op(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """`grouped_mm` as one graph node of a compiled block (engine/compile.py): torch's meta kernel takes bf16 only, so
    an fp32 trace of F.grouped_mm fails, and transformers' fallback reads the offsets on the host. The fake says only
    the output's shape, (S, out): S is the input's (tokens x top-k), static per run. x (S, in), rows sorted by
    expert, @ w (E, in, out) per expert; offsets (E,) int32 cumulative rows."""
    # torch's grouped kernel may pad the output's row stride to 16 bytes: the fake says contiguous
    return grouped_mm(x, w, offsets).contiguous()


@grouped_mm_op.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("shardtune::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_x: bool,
                        need_w: bool) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_w) of `grouped_mm_op`, as an eager run's autograd computes them (bit for bit: the same kernel
    calls as torch's grouped_mm derivative, or transformers' fallback backward op). An unneeded one is empty."""
    grad = grad.contiguous()
    if not torch_grouped_kernel(x, w):
        gx, gw = torch.ops.transformers.grouped_mm_fallback_backward(x, w, offsets, grad)
    else:
        gx = F.grouped_mm(grad, w.transpose(-2, -1), offs=offsets) if need_x else None
        gw = F.grouped_mm(x.t(), grad, offs=offsets) if need_w else None  # (E, in, out): rows of expert e
    gx = gx.contiguous() if need_x else x.new_empty(0)
    gw = gw.contiguous() if need_w else w.new_empty(0)
    return gx, gw


@grouped_mm_backward.register_fake
def _(grad: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape) if need_x else x.new_empty(0)), (w.new_empty(w.shape) if need_w else w.new_empty(0))


def _grouped_setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, w, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gx, gw = grouped_mm_backward(grad, x, w, offsets, need_x, need_w)
    return (gx if need_x else None), (gw if need_w else None), None


grouped_mm_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)
