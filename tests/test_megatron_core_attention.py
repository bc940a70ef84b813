"""Megatron-core 0.16.1's own ``DotProductAttention`` (its unfused attention with the sliding-window
mask of ``window_size`` on the layers ``window_attn_skip_freq`` picks, and its ``softmax_type``
"off-by-one" / "learnable" softmax with the extra column) against megatron_ext's
``ContextParallelDotProductAttention`` built from the same config: same outputs and gradients in
float64, the learnable ``softmax_offset`` under the same state-dict key with the same shape. It
pins Megatron-core's window convention (query i sees keys i - left .. i) and sink semantics.
The CUDA calls Megatron-core makes on a CPU are patched as ``benchmarks/megatron_core_gpt.py``
lists, in a process of its own. Skipped when megatron-core is not installed."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.distributed as dist

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.conftest import TIGHT, Comparisons, assert_comparisons  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

# (window_size, window_attn_skip_freq, softmax_type)
CASES = [
    ((3, 0), None, "vanilla"),
    ((0, 0), None, "vanilla"),  # the query alone
    ((5, 0), 2, "learnable"),  # the window on odd layers only
    ((5, 0), [0, 1], "off-by-one"),
    (None, None, "learnable"),
]


def _worker() -> list:
    from benchmarks.megatron_core_gpt import cpu_patches

    cpu_patches(full=True)  # this process is retired after: the default group is destroyed below
    from megatron.core import parallel_state as mcore_ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.transformer.context_parallel import ContextParallelDotProductAttention

    mcore_ps.initialize_model_parallel(1, 1)
    # Its attention-dropout fork needs the tracker; the inference one runs on the CPU generator.
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    groups = types.SimpleNamespace(tp=mcore_ps.get_tensor_model_parallel_group(), cp=None)
    cmp = Comparisons()
    g = torch.Generator().manual_seed(0)
    s, b = 12, 2
    for window_size, skip_freq, softmax_type in CASES:
        config = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, window_size=window_size,
            window_attn_skip_freq=skip_freq, softmax_type=softmax_type, attention_dropout=0.0,
            params_dtype=torch.float64, use_cpu_initialization=True,
        )
        for layer in (1, 2):
            label = f"window_size={window_size} skip={skip_freq} {softmax_type} layer {layer}"
            theirs = DotProductAttention(config, layer, AttnMaskType.causal, "self")
            ours = ContextParallelDotProductAttention(config, layer, AttnMaskType.causal, "self",
                                                      pg_collection=groups)
            assert sorted(theirs.state_dict()) == sorted(ours.state_dict()), label
            if softmax_type == "learnable":
                ours.load_state_dict(theirs.state_dict())
            q = torch.randn(s, b, 4, 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(s, b, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
            grad = torch.randn(s, b, 32, generator=g, dtype=torch.float64)
            results = []
            for module in (theirs, ours):
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                out = module(*leaves, attention_mask=None, attn_mask_type=AttnMaskType.causal)
                out.backward(grad)
                offset = [] if softmax_type != "learnable" else [module.softmax_offset.grad]
                results.append([out, *(t.grad for t in leaves), *offset])
            for name, got, want in zip("out dq dk dv dsinks".split(), results[1], results[0]):
                cmp.close(got, want, f"{label} {name}", **TIGHT)
    mcore_ps.destroy_model_parallel()
    dist.destroy_process_group()  # the process does not serve another test
    return cmp.made


@pytest.mark.slow  # a process of its own importing megatron-core
def test_windows_and_sinks_as_megatron_core_dot_product_attention():
    (made,) = run_distributed(1, _worker)
    assert_comparisons(made)
    assert len(made) == 4 * 2 * 2 + 2 * 5 * 2 + 2 * 4
