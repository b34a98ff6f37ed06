"""One long packed row, forward + backward: the per-document attention (model/attention.py) and the sequence-tiled
MLP and norms (model/tiled_mlp.py) over D documents and s / C chunks. Their backward used to write a zero-filled
gradient of the whole input per document and per chunk; this times the step at a few document counts (CPU, one
thread, median of 3). Run it at two commits to compare them:

    .venv/bin/python bench/packed_backward.py                        # s=8192, hidden 256, 2 layers, C=512
    PYTHONPATH=/tmp/old/src .venv/bin/python bench/packed_backward.py   # the same at another checkout
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from shardtune.bundled import CONFIGS_DIR
from shardtune.config.schema import ModelConfig
from shardtune.data.packing import doc_lengths
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.wrap import find_units
from shardtune.model.build import build_model
from shardtune.model.tiled_mlp import apply_sequence_chunking


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="engine.mlp_chunk_tokens (0: off)")
    ap.add_argument("--docs", type=int, nargs="*", default=[1, 16, 64, 256])
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = json.loads((CONFIGS_DIR / "models" / "tiny-llama.json").read_text())
    config.update(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875), num_hidden_layers=args.layers,
                  max_position_embeddings=args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "model.json"
        cfg.write_text(json.dumps(config))
        model = build_model(ModelConfig(config=str(cfg)), seed=0)
    if args.chunk:
        apply_sequence_chunking(find_units(model, (type(model.model.layers[0]),), None), chunk_tokens=args.chunk)
    ids = torch.randint(3, 128, (1, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"s={args.seq} hidden={args.hidden} layers={args.layers} mlp_chunk_tokens={args.chunk}, fp32, one thread\n")
    print("| documents | forward + backward, ms |\n|---:|---:|")
    for docs in args.docs:
        n = args.seq // docs
        pos = torch.cat([torch.arange(n)] * docs + [torch.arange(args.seq - n * docs)])[None]
        lengths = doc_lengths(pos.numpy())
        times = []
        for _ in range(4):  # the first is a warm-up
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            token_loss_sum(model, ids, ids, pos, doc_lengths=lengths).backward()
            times.append(time.perf_counter() - t0)
        print(f"| {docs} | {sorted(times[1:])[1] * 1000:,.0f} |")


if __name__ == "__main__":
    main()
