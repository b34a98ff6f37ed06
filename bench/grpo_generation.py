"""GRPO generation speed on CPU (trainer/sampling.py) against transformers' `generate(do_sample=True)` on the same
model: batch 8 (2 prompts x 4 generations), 64 new tokens each (no stop id: every row runs to the budget), top-k 50,
temperature 1, one process on one thread, the unsharded model on SDPA for both. Tokens/s = 8 x 64 / the best of 3
runs' CPU time (process time: the figure holds on a loaded machine, where wall time measures the neighbours), the
two alternating.

    .venv/bin/python bench/grpo_generation.py                 # configs/models/tiny-llama.json, 4 layers
    .venv/bin/python bench/grpo_generation.py --layers 1
"""
from __future__ import annotations

import argparse
import time

import torch

from shardtune.config.schema import ModelConfig
from shardtune.model.build import build_model
from shardtune.trainer.sampling import sample_completions

PROMPTS = [[5, 9, 17, 3, 44, 6, 90, 91], [33, 34, 35, 36, 37, 8, 8, 9]]
GENERATIONS, NEW_TOKENS = 4, 64


def best_of(fns, runs: int = 3) -> list[float]:
    """The best time of each function, run in turn (the machine's load shifts over a run: alternating is fairer)."""
    best = [float("inf")] * len(fns)
    for r in range(runs + 1):
        for i, fn in enumerate(fns):
            t0 = time.process_time()
            fn()
            if r:  # the first round warms up
                best[i] = min(best[i], time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/models/tiny-llama.json")
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    args = ap.parse_args()
    torch.set_num_threads(1)  # process time then counts the work, not threads spinning for each other
    model = build_model(ModelConfig(config=args.config), seed=0).eval()
    if args.layers is not None:
        model.model.layers = model.model.layers[:args.layers]
        model.config.num_hidden_layers = args.layers
    tokens = len(PROMPTS) * GENERATIONS * NEW_TOKENS

    def ours() -> None:
        out = sample_completions(model, PROMPTS, keys=[(0, 0, i) for i in range(len(PROMPTS))],
                                 num_generations=GENERATIONS, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=50,
                                 stop_ids=[], pad_id=0, device="cpu")
        assert sum(map(len, out)) == tokens

    ids = torch.tensor(PROMPTS).repeat_interleave(GENERATIONS, 0)
    hf_model = build_model(ModelConfig(config=args.config), seed=0).eval()
    if args.layers is not None:
        hf_model.model.layers = hf_model.model.layers[:args.layers]
        hf_model.config.num_hidden_layers = args.layers
    hf_model.set_attn_implementation("sdpa")

    def transformers() -> None:
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                    temperature=1.0, top_k=50, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert out.shape == (len(ids), ids.shape[1] + NEW_TOKENS)

    ours_s, hf_s = best_of([ours, transformers])
    layers = model.config.num_hidden_layers
    print(f"{args.config} ({layers} layers), batch {len(ids)}, {NEW_TOKENS} new tokens, "
          f"1 thread: sample_completions {tokens / ours_s:,.0f} tokens/CPU-s, transformers generate(do_sample=True) "
          f"{tokens / hf_s:,.0f} tokens/CPU-s, ratio {hf_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
