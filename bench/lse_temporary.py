"""The C x V temporary inside torch.logsumexp, against the chunked loss's in-place log-sum-exp (engine/loss.py
softmax_lse_): peak RSS growth of this process over one 1,024-token chunk at Llama-3's 128,256 vocabulary, fp32.
Each allocation this large is its own mmap, returned when freed, so the RSS peak follows the live bytes.

    .venv/bin/python bench/lse_temporary.py
"""
from __future__ import annotations

import resource

import torch

from shardtune.engine.loss import softmax_lse_

GiB = 2**30


def peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def main() -> None:
    logits = torch.randn(1024, 128256)
    copy = logits.clone()
    before = peak()  # ours first: ru_maxrss only rises, so the op measured second must exceed the first's peak
    got = softmax_lse_(copy)
    ours_growth = peak() - before
    before = peak()
    want = torch.logsumexp(logits, dim=-1)
    torch_growth = peak() - before
    print(f"chunk {logits.numel() * 4 / GiB:.3f} GiB fp32: torch.logsumexp +{torch_growth:.3f} GiB peak RSS, "
          f"softmax_lse_ +{ours_growth:.3f} GiB; max |lse difference| {(want - got).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
