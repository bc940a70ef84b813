"""Megatron-style tensor, pipeline and data parallelism as a PyTorch C++/CUDA extension.

``from megatron_ext import parallel_state, tensor_parallel`` is a drop-in for
``from megatron.core import parallel_state, tensor_parallel``.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from megatron_ext import _C
from megatron_ext import _ops  # noqa: F401  (fake kernels of the C++ ops)
from megatron_ext import parallel_state, pipeline_parallel, tensor_parallel
from megatron_ext.model_parallel_config import ModelParallelConfig

__version__ = "0.1.0"


def build_info() -> dict:
    """How the C++ extension was built: ``torch_version``, ``cuda_compiled``, ``cuda_version``,
    ``cuda_archs``."""
    return dict(_C.build_info())


__all__ = [
    "ModelParallelConfig",
    "build_info",
    "parallel_state",
    "pipeline_parallel",
    "tensor_parallel",
    "__version__",
]


