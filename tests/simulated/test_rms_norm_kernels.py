"""F.rms_norm on the simulated GPU takes CUDA's branch (simulated/rms_norm.py): a Llama block's RMSNorm is one
`_fused_rms_norm` launch forward and one `_fused_rms_norm_backward` backward, with CUDA's output and rstd shapes and
dtypes, where the CPU build's decomposition ran ~6 and ~12. Checked on a simulated rank, where the kernels are
installed (never in this test process)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.model.rms_norm import use_fused_rms_norm
from shardtune.simulated.launches import LaunchCounter
from tests.simulated.harness import run_simulated


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # detach, expand: no kernel
            self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _one_fused_kernel_each_way() -> None:
    aten = torch.ops.aten
    x = torch.empty(2, 5, 64, dtype=torch.bfloat16, device="meta")
    out, rstd = aten._fused_rms_norm(x, [64], None, 1e-5)
    assert (out.shape, out.dtype, out.is_contiguous()) == (x.shape, torch.bfloat16, True)
    assert (rstd.shape, rstd.dtype) == ((2, 5, 1), torch.float32)  # CUDA's: accumulate type, 1 per normalised dim

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    model.to(torch.bfloat16)
    use_fused_rms_norm(model)
    norm = model.model.layers[0].input_layernorm
    h = torch.empty(2, 5, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    grad = torch.empty(2, 5, 64, dtype=torch.bfloat16, device="meta")
    with _Names() as seen, LaunchCounter(1) as counter:
        y = norm(h)
        forward = list(seen.names)
        y.backward(grad)
    backward = seen.names[len(forward):]
    # transformers' arithmetic around the kernel: the fp32 upcast, the cast back, the weight product
    assert forward == ["_to_copy", "_fused_rms_norm", "_to_copy", "mul"], forward
    # the weight product's two products and the weight's sum, the casts back, one fused kernel
    assert backward == ["mul", "mul", "sum", "_to_copy", "_fused_rms_norm_backward", "_to_copy"], backward
    assert (counter.counts[0, "forward"], counter.counts[0, "backward"]) == (4, 6)
    assert h.grad.shape == h.shape and h.grad.dtype == torch.bfloat16


def test_rms_norm_is_one_fused_kernel_each_way_on_the_simulated_gpu() -> None:
    run_simulated(_one_fused_kernel_each_way, 1)
