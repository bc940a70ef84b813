// The index builders of megatron_ext.datasets (sample index, blending indices): plain functions of
// the extension's Python module, as they read and write NumPy arrays in place.
#pragma once

#include <pybind11/pybind11.h>

namespace megatron_ext::datasets {

// Adds build_sample_idx_int32/_int64, build_blending_indices and
// build_exhaustive_blending_indices to the module.
void register_helpers(pybind11::module_& module);

}  // namespace megatron_ext::datasets
