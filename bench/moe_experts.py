"""Mixture-of-experts layer on CPU: forward + backward time of one experts module, per-expert Python loop
(transformers' `eager` experts) vs grouped matmul (transformers' `grouped_mm`, and ours, model/experts.py, which also
runs LoRA on every expert and NF4 experts), fp32, one process.

    python bench/moe_experts.py                                   # Qwen3-MoE-shaped layer, 64 experts, top-8
    python bench/moe_experts.py --experts 128 --hidden 1024 --inter 384 --tokens 2048

The layer is Qwen3MoeExperts from a scaled-down Qwen3-30B-A3B config (its 128 experts, top-8, moe_intermediate
768, hidden 2048 by default divided by --scale). Routing is drawn once (softmax of a random router) and shared by
every variant, so each computes the same thing (outputs checked equal to the loop's). Timing: median of --repeats
forward+backward passes after 2 warm-ups, torch threads as set (the CI machine: 2 cores, shared).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from shardtune.model.experts import ExpertLora, register_experts_implementation


def layer(args: argparse.Namespace, implementation: str) -> Qwen3MoeExperts:
    cfg = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
                         num_experts_per_tok=args.top_k)
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    m = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.02)
        m.down_proj.normal_(0, 0.02)
    return m


def with_lora(m: Qwen3MoeExperts, r: int) -> Qwen3MoeExperts:
    g = torch.Generator().manual_seed(0)
    for w in ("gate_up_proj", "down_proj"):
        e, out_f, in_f = getattr(m, w).shape
        lora = ExpertLora(e, in_f, out_f, r=r, alpha=2 * r)
        lora.reset(g)
        m.add_module(f"lora_{w}", torch.nn.ModuleDict({"default": lora}))
        getattr(m, w).requires_grad_(False)
    return m


def time_it(m: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    times, y = [], None
    for i in range(repeats + 2):
        xi = x.detach().requires_grad_()
        t0 = time.perf_counter()
        y = m(xi, idx, w)
        y.backward(torch.ones_like(y))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), y.detach()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=192)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lora-r", type=int, default=16)
    args = p.parse_args()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    probs = torch.softmax(torch.randn(args.tokens, args.experts, generator=g), -1)
    w, idx = torch.topk(probs, args.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ours = register_experts_implementation()
    variants = {"loop (transformers eager)": layer(args, "eager"),
                "grouped_mm (transformers)": layer(args, "grouped_mm"),
                "grouped_mm (shardtune)": layer(args, ours),
                f"grouped_mm (shardtune) + LoRA r={args.lora_r} per expert": with_lora(layer(args, ours),
                                                                                args.lora_r)}
    print(f"experts={args.experts} top_k={args.top_k} hidden={args.hidden} inter={args.inter} tokens={args.tokens} "
          f"threads={torch.get_num_threads()} torch={torch.__version__}")
    base_t, base_y = None, None
    for name, m in variants.items():
        t, y = time_it(m, x, idx, w, args.repeats)
        if base_y is None:
            base_t, base_y = t, y
        err = (y - base_y).abs().max().item()
        print(f"| {name} | {t * 1000:.1f} ms | {base_t / t:.2f}x | max |y - loop| {err:.1e} |")


if __name__ == "__main__":
    main()
