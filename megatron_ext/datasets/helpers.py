"""The index builders, compiled into megatron_ext's extension (csrc/datasets/helpers.cpp), with
the names and signatures of Megatron-core's ``megatron.core.datasets.helpers``."""

from __future__ import annotations

import numpy

from megatron_ext._C import (  # noqa: F401 (the module's interface)
    build_blending_indices,
    build_exhaustive_blending_indices,
    build_sample_idx_int32,
    build_sample_idx_int64,
)


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """The [num_samples + 1, 2] sample index: int32 entries when they fit, int64 otherwise."""
    largest = max(document_indices.shape[0], int(sizes.max()) if sizes.size else 0)
    build = build_sample_idx_int32 if largest <= numpy.iinfo(numpy.int32).max else build_sample_idx_int64
    return build(
        sizes,
        document_indices,
        sequence_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        1 if add_extra_token_to_sequence else 0,
    )
