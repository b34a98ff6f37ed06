"""Device-resident activation peak with engine.offload_activations against plain activation checkpointing, measured
with the CPU tracker (host buffers counted apart), one process, one forward + backward of packed rows.

  python bench/offload_ratio.py                       # tiny-llama (4 layers) and a 32-layer twin, seq 8,192
  python bench/offload_ratio.py --layers 32 --chunk 1024

The activation peak is the tracker's peak less what was alive before the forward (parameters, their preallocated
gradients). Printed per configuration: checkpointed peak, offloaded peak, their ratio, the host bytes.
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardtune.bundled import CONFIGS_DIR
from shardtune.data import packing
from shardtune.engine.checkpointing import apply_activation_checkpointing
from shardtune.engine.loss import token_loss_sum
from shardtune.engine.offload_activations import ActivationOffloader
from shardtune.engine.wrap import find_units
from shardtune.memory import CpuMemoryTracker
from shardtune.model import attention
from shardtune.model.tiled_mlp import apply_sequence_chunking

DOCS = 3  # documents per packed row


def activation_peak(*, layers: int, seq: int, chunk: int, offload: bool, loss_chunk: int = 1024) -> tuple[int, int]:
    """(device activation peak, host peak) in bytes for one fp32 step of tiny-llama with `layers` blocks."""
    cfg = json.loads((CONFIGS_DIR / "models" / "tiny-llama.json").read_text())
    cfg.update(num_hidden_layers=layers, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg),
                                             attn_implementation=attention.register()).float()
    if chunk:
        apply_sequence_chunking(find_units(model, (LlamaDecoderLayer,), None), chunk_tokens=chunk)
    offloader = ActivationOffloader(torch.device("cpu")) if offload else None
    apply_activation_checkpointing(model, (LlamaDecoderLayer,), offloader=offloader)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # allocated before the tracker: only activations move the peak
    ids = torch.randint(3, cfg["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    n = seq // DOCS
    pos = torch.cat([torch.arange(n)] * (DOCS - 1) + [torch.arange(seq - n * (DOCS - 1))])[None]
    tracker = CpuMemoryTracker().start()
    base = tracker.live_bytes()
    try:
        loss = token_loss_sum(model, ids, ids, pos, chunk_tokens=loss_chunk, doc_lengths=packing.doc_lengths(pos))
        loss.backward()
    finally:
        tracker.stop()
    return tracker.peak_bytes() - base, tracker.host_peak_bytes()


def ratio(*, layers: int, seq: int, chunk: int) -> dict:
    ck, _ = activation_peak(layers=layers, seq=seq, chunk=chunk, offload=False)
    off, host = activation_peak(layers=layers, seq=seq, chunk=chunk, offload=True)
    return {"layers": layers, "seq": seq, "mlp_chunk_tokens": chunk, "checkpointed": ck, "offloaded": off,
            "ratio": off / ck, "host": host}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 32])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--chunk", type=int, nargs="*", default=[0, 1024])
    a = ap.parse_args()
    torch.set_num_threads(1)
    for layers in a.layers:
        for chunk in a.chunk:
            r = ratio(layers=layers, seq=a.seq, chunk=chunk)
            print(f"layers {layers:3d} mlp_chunk {chunk:5d}: checkpointed {r['checkpointed'] / 2**20:8.2f} MiB  "
                  f"offloaded {r['offloaded'] / 2**20:8.2f} MiB  ratio {r['ratio']:.3f}  host {r['host'] / 2**20:.2f} MiB",
                  flush=True)


if __name__ == "__main__":
    main()
