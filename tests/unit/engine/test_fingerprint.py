"""The start-up checksum is exact on bits: equal tensors agree, any one-element change or swap does not."""
from __future__ import annotations

import pytest
import torch

from shardtune.model import fingerprint
from shardtune.model.fingerprint import MIN_CHUNK, checksum
from shardtune.model.seeded_init import module_seed


@pytest.mark.parametrize("path", ["xxh3", "integer-sums"])
def test_checksum_sees_every_element_and_order(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of hashing: host tensors' bytes through XXH3, a device tensor's integer sums (run here on the CPU)."""
    if path == "integer-sums":
        monkeypatch.setattr(fingerprint, "_XXH3_DEVICES", ())
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 * MIN_CHUNK + 7, generator=g)  # several chunks and a ragged tail
    small = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    base = checksum([big, small])
    assert checksum([big.clone(), small.clone()]) == base
    for i in (0, MIN_CHUNK, big.numel() - 1):
        tweaked = big.clone()
        tweaked[i] = torch.nextafter(tweaked[i], torch.tensor(float("inf")))  # one ulp
        assert checksum([tweaked, small]) != base, i
    swapped = big.clone()
    swapped[[1, 2]] = swapped[[2, 1]]
    assert checksum([swapped, small]) != base
    assert checksum([small, big]) != base  # order of tensors
    assert checksum([big, small.float()]) != base  # dtype


def test_module_seed_ignores_the_lora_wrapper_only() -> None:
    assert module_seed(0, "model.layers.0.self_attn.q_proj.base_layer") == module_seed(0, "model.layers.0.self_attn.q_proj")
    assert module_seed(0, "model.layers.0.mlp") != module_seed(0, "model.layers.1.mlp")
    assert module_seed(0, "model.layers.0.mlp") != module_seed(1, "model.layers.0.mlp")
