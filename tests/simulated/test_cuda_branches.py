"""The simulated GPU takes the branches CUDA takes (issue 58): no "is this meta" test outside the device seam.
  - vocab-parallel's token count is agreed over the host group on the simulated GPU too (engine/vocab.py
    `max_tokens`), so ranks with different counts pad to the largest, as on CUDA;
  - attention given position ids without their documents reads them from the device: a host sync per call on CUDA,
    counted on the simulated GPU (which, with no values to read, takes one document per row: accelerator.host_values).
Checked on simulated ranks (their host group is gloo across the rank processes)."""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

from shardtune import accelerator
from shardtune.engine.vocab import VocabTable
from shardtune.model.attention import document_attention
from tests.simulated.harness import run_simulated


def _ranks_agree_on_the_largest_count() -> None:
    rank = dist.get_rank()
    table = types.SimpleNamespace(device=torch.device("meta"), group=dist.group.WORLD)
    assert VocabTable.max_tokens(table, 3 + rank, first=True) == 4  # rank 0 has 3 tokens, rank 1 has 4


def test_vocab_token_counts_are_agreed_on_the_simulated_gpu() -> None:
    run_simulated(_ranks_agree_on_the_largest_count, 2)


def _position_ids_read_from_the_device() -> None:
    q = torch.empty(2, 4, 8, 16, device="meta")
    kv = torch.empty(2, 2, 8, 16, device="meta")
    position_ids = torch.empty(1, 8, dtype=torch.long, device="meta")
    accelerator.TRACE.clear()
    out, _ = document_attention(torch.nn.Module(), q, kv, kv, None, position_ids=position_ids)
    assert out.shape == (2, 8, 4, 16)
    assert accelerator.host_syncs() == [("to_host", "shardtune.model.attention:document_attention")]


def test_attention_reads_position_ids_on_the_simulated_gpu() -> None:
    run_simulated(_position_ids_read_from_the_device, 1)
