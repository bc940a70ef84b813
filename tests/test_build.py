"""The extension's build facts, op registrations and the vocabulary-mask kernel."""

import os

import pytest
import torch

import megatron_ext
from tests.conftest import has_kernel

REGION_OPS = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
]


def test_build_info_matches_torch():
    info = megatron_ext.build_info()
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda_compiled"], bool)
    if info["cuda_compiled"]:
        assert info["cuda_archs"] and info["cuda_version"] == torch.version.cuda
    else:
        assert info["cuda_archs"] == "" and info["cuda_version"] == ""


def test_cuda_kernels_registered_when_compiled():
    info = megatron_ext.build_info()
    if os.environ.get("FORCE_CUDA") == "1":  # how CI builds: the CUDA sources must be in, for
        # the archs TORCH_CUDA_ARCH_LIST named
        assert info["cuda_compiled"]
        wanted = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        for arch in wanted.replace(" ", ";").split(";"):
            if arch:
                assert arch.replace("+PTX", "") in info["cuda_archs"], (arch, info["cuda_archs"])
    for op in ("vocab_range_mask", "moe_gather_rows", "moe_scatter_add_rows", "moe_gathered_row_dot"):
        assert has_kernel(op, "CUDA") == info["cuda_compiled"], op
        assert has_kernel(op, "CPU"), op


@pytest.mark.parametrize("op", REGION_OPS)
def test_region_ops_have_backend_autograd_and_fake_kernels(op):
    assert has_kernel(op, "CompositeExplicitAutograd")
    assert has_kernel(op, "Autograd")
    assert has_kernel(op, "Meta")


def test_vocab_range_mask_cpu():
    ids = torch.tensor([[0, 3, 5], [6, 9, 4]])
    local, outside = torch.ops.megatron_ext.vocab_range_mask(ids, 3, 6)
    assert local.tolist() == [[0, 0, 2], [0, 0, 1]]
    assert outside.tolist() == [[True, False, False], [True, True, False]]
    big = torch.randint(0, 1000, (4097,), dtype=torch.int32)
    local, outside = torch.ops.megatron_ext.vocab_range_mask(big, 250, 500)
    expected_outside = (big < 250) | (big >= 500)
    assert torch.equal(outside, expected_outside)
    assert torch.equal(local, torch.where(expected_outside, 0, big.long() - 250))


def test_vocab_range_mask_errors_and_opcheck():
    with pytest.raises(ValueError, match="integer tensor, got Float"):
        torch.ops.megatron_ext.vocab_range_mask(torch.ones(3), 0, 2)
    with pytest.raises(ValueError, match=r"0 <= first <= last, got \[5, 2\)"):
        torch.ops.megatron_ext.vocab_range_mask(torch.ones(3, dtype=torch.long), 5, 2)
    torch.library.opcheck(torch.ops.megatron_ext.vocab_range_mask.default, (torch.tensor([1, 7, 3]), 2, 5))
