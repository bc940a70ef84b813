// The index builders behind GPTDataset and BlendedDataset, with the signatures, arithmetic and
// results of Megatron-core's helpers_cpp (megatron/core/datasets/helpers.cpp), so that the arrays
// they produce, and so the cache files, are the same.
//
// They are plain pybind11 functions rather than dispatcher ops: their inputs are NumPy arrays,
// often read-only memory maps of a corpus's index (which torch.from_numpy cannot wrap without a
// copy), the blending builders fill arrays the caller allocated, and their results are saved with
// numpy.save. Nothing about them has a gradient, a device or a traced graph. The loops run without
// the GIL, so the builders of several datasets can run in threads.
#include "helpers.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

namespace py = pybind11;

namespace megatron_ext::datasets {
namespace {

// A read-only input: any numeric array, converted to a contiguous array of T when it is not one.
template <typename T>
using InputArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
void check_one_dim(const InputArray<T>& array, const char* name) {
  if (array.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be a 1-D array, got " +
                          std::to_string(array.ndim()) + " dimensions");
  }
}

// An output the caller allocated: it must be a writable contiguous 1-D array of exactly T (a
// converted copy would take the results and be dropped) with room for ``size`` entries.
template <typename T>
T* output_pointer(py::array& array, const char* name, const char* dtype_name, int64_t size) {
  if (!array.dtype().is(py::dtype::of<T>())) {
    throw py::value_error(std::string(name) + " must be a numpy." + dtype_name + " array, got " +
                          py::str(array.dtype()).cast<std::string>());
  }
  if (array.ndim() != 1 || !(array.flags() & py::array::c_style) || !array.writeable()) {
    throw py::value_error(std::string(name) + " must be a writable contiguous 1-D array");
  }
  if (array.shape(0) < size) {
    throw py::value_error(std::string(name) + " holds " + std::to_string(array.shape(0)) +
                          " entries; " + std::to_string(size) + " are needed");
  }
  return static_cast<T*>(array.mutable_data());
}

void check_num_datasets(int32_t num_datasets, int64_t given, const char* what) {
  if (num_datasets < 1 || num_datasets >= std::numeric_limits<int16_t>::max()) {
    throw py::value_error("num_datasets must be in [1, 32767), got " +
                          std::to_string(num_datasets));
  }
  if (given != num_datasets) {
    throw py::value_error(std::string(what) + " has " + std::to_string(given) +
                          " entries; num_datasets is " + std::to_string(num_datasets));
  }
}

// Each sample goes to the dataset furthest behind its share of the samples drawn so far (the
// first such dataset on ties); ``dataset_sample_index`` counts the samples drawn from it.
void build_blending_indices(py::array& dataset_index, py::array& dataset_sample_index,
                            const InputArray<double>& weights, int32_t num_datasets, int64_t size,
                            bool verbose) {
  check_one_dim(weights, "weights");
  check_num_datasets(num_datasets, weights.shape(0), "weights");
  if (size < 0) throw py::value_error("size must be >= 0, got " + std::to_string(size));
  auto* index = output_pointer<int16_t>(dataset_index, "dataset_index", "int16", size);
  auto* sample_index =
      output_pointer<int64_t>(dataset_sample_index, "dataset_sample_index", "int64", size);
  const double* w = weights.data();
  std::vector<int64_t> drawn(num_datasets, 0);
  {
    py::gil_scoped_release no_gil;
    for (int64_t sample = 0; sample < size; ++sample) {
      const double progress = std::max(static_cast<double>(sample), 1.0);
      int32_t behind = 0;
      double most_behind = w[0] * progress - static_cast<double>(drawn[0]);
      for (int32_t d = 1; d < num_datasets; ++d) {
        const double shortfall = w[d] * progress - static_cast<double>(drawn[d]);
        if (shortfall > most_behind) {
          most_behind = shortfall;
          behind = d;
        }
      }
      index[sample] = static_cast<int16_t>(behind);
      sample_index[sample] = drawn[behind]++;
    }
  }
  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int32_t d = 0; d < num_datasets; ++d) {
      const double ratio = size > 0 ? static_cast<double>(drawn[d]) / size : 0.0;
      std::cout << "   dataset " << d << ", input: " << w[d] << ", achieved: " << ratio
                << std::endl;
    }
  }
}

// As build_blending_indices with weights proportional to ``sizes``, drawing exactly sizes[d]
// samples from dataset d: a dataset leaves the draw once it is spent.
void build_exhaustive_blending_indices(py::array& dataset_index, py::array& dataset_sample_index,
                                       const InputArray<int64_t>& sizes, int32_t num_datasets) {
  check_one_dim(sizes, "sizes");
  check_num_datasets(num_datasets, sizes.shape(0), "sizes");
  const int64_t* n = sizes.data();
  int64_t total = 0;
  for (int32_t d = 0; d < num_datasets; ++d) {
    if (n[d] < 1) {
      throw py::value_error("sizes must be >= 1, got " + std::to_string(n[d]) + " for dataset " +
                            std::to_string(d));
    }
    total += n[d];
  }
  auto* index = output_pointer<int16_t>(dataset_index, "dataset_index", "int16", total);
  auto* sample_index =
      output_pointer<int64_t>(dataset_sample_index, "dataset_sample_index", "int64", total);
  py::gil_scoped_release no_gil;
  std::vector<double> weight(num_datasets);
  for (int32_t d = 0; d < num_datasets; ++d) weight[d] = n[d] / static_cast<double>(total);
  std::vector<int64_t> drawn(num_datasets, 0);
  std::vector<char> spent(num_datasets, 0);
  for (int64_t sample = 0; sample < total; ++sample) {
    const double progress = std::max(static_cast<double>(sample), 1.0);
    int32_t behind = -1;
    double most_behind = std::numeric_limits<double>::lowest();
    for (int32_t d = 0; d < num_datasets; ++d) {
      if (spent[d]) continue;
      const double shortfall = weight[d] * progress - static_cast<double>(drawn[d]);
      if (shortfall > most_behind) {
        most_behind = shortfall;
        behind = d;
      }
    }
    index[sample] = static_cast<int16_t>(behind);
    sample_index[sample] = drawn[behind]++;
    if (drawn[behind] == n[behind]) spent[behind] = 1;
  }
}

// The sample index of a GPT dataset: row i is (position in document_idx, token offset in that
// document) where sample i starts; sample i ends where sample i + 1 starts, plus the extra token.
// The documents of ``document_idx`` are read as one stream of tokens; num_samples + 1 rows.
template <typename T>
py::array_t<T> build_sample_idx(const InputArray<int32_t>& sizes_,
                                const InputArray<int32_t>& document_idx_, int32_t seq_length,
                                int32_t num_epochs, int64_t tokens_per_epoch,
                                bool drop_last_partial_sequence, int add_extra_token_to_sequence) {
  check_one_dim(sizes_, "sizes");
  check_one_dim(document_idx_, "document_indices");
  if (seq_length < 1) {
    throw py::value_error("sequence_length must be >= 1, got " + std::to_string(seq_length));
  }
  if (num_epochs < 1) {
    throw py::value_error("num_epochs must be >= 1, got " + std::to_string(num_epochs));
  }
  if (add_extra_token_to_sequence != 0 && add_extra_token_to_sequence != 1) {
    throw py::value_error("add_extra_token_to_sequence must be 0 or 1, got " +
                          std::to_string(add_extra_token_to_sequence));
  }
  const int32_t* sizes = sizes_.data();
  const int32_t* document_idx = document_idx_.data();
  const int64_t num_sizes = sizes_.shape(0);
  const int64_t num_documents = document_idx_.shape(0);
  for (int64_t i = 0; i < num_documents; ++i) {
    if (document_idx[i] < 0 || document_idx[i] >= num_sizes) {
      throw py::value_error("document_indices[" + std::to_string(i) +
                            "] = " + std::to_string(document_idx[i]) + " is outside the " +
                            std::to_string(num_sizes) + " sequence lengths");
    }
  }
  const int64_t tokens = num_epochs * tokens_per_epoch - add_extra_token_to_sequence;
  // Megatron-core rounds the partial sequence up in single precision; so do we, for equal counts.
  const int64_t num_samples =
      drop_last_partial_sequence
          ? tokens / seq_length
          : static_cast<int64_t>(std::ceil(static_cast<float>(tokens) / seq_length));
  if (num_samples > 0 && num_documents == 0) {
    throw py::value_error("document_indices is empty, yet " + std::to_string(num_samples) +
                          " samples are asked of it");
  }
  const int64_t rows = std::max<int64_t>(num_samples, 0) + 1;
  py::array_t<T> result({rows, static_cast<int64_t>(2)});
  T* sample_idx = result.mutable_data();
  {
    py::gil_scoped_release no_gil;
    int64_t row = 0;
    T document = 0;
    T offset = 0;
    sample_idx[0] = document;
    sample_idx[1] = offset;
    ++row;
    while (row <= num_samples) {
      int32_t remaining = seq_length + add_extra_token_to_sequence;
      while (remaining != 0) {
        const auto length = sizes[document_idx[document]] - offset;
        remaining -= length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts where the extra token is.
          offset += remaining + length - add_extra_token_to_sequence;
          remaining = 0;
        } else if (document == num_documents - 1) {
          // The stream ends: a partial last sample, or the rounding of a partial one.
          offset = sizes[document_idx[document]] - add_extra_token_to_sequence;
          break;
        } else {
          ++document;
          offset = 0;
        }
      }
      sample_idx[2 * row] = document;
      sample_idx[2 * row + 1] = offset;
      ++row;
    }
  }
  return result;
}

}  // namespace

void register_helpers(py::module_& module) {
  module.def(
      "build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
      py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"), py::arg("size"),
      py::arg("verbose"),
      "Fills dataset_index (int16) and dataset_sample_index (int64) with the first ``size`` "
      "samples of a blend of num_datasets datasets drawn in the proportions of ``weights``.");
  module.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
             py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("sizes"),
             py::arg("num_datasets"),
             "Fills dataset_index and dataset_sample_index with a blend drawing exactly sizes[d] "
             "samples from dataset d.");
  const char* sample_idx_doc =
      "The [num_samples + 1, 2] sample index of a GPT dataset: (position in document_indices, "
      "token offset) where each sample starts; int32 or int64 entries.";
  module.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"),
             py::arg("document_indices"), py::arg("sequence_length"), py::arg("num_epochs"),
             py::arg("tokens_per_epoch"), py::arg("drop_last_partial_sequence") = true,
             py::arg("add_extra_token_to_sequence") = 1, sample_idx_doc);
  module.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"),
             py::arg("document_indices"), py::arg("sequence_length"), py::arg("num_epochs"),
             py::arg("tokens_per_epoch"), py::arg("drop_last_partial_sequence") = true,
             py::arg("add_extra_token_to_sequence") = 1, sample_idx_doc);
}

}  // namespace megatron_ext::datasets
