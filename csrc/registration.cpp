// The library's schema block (ops that declare theirs beside their kernels aside), and the
// Python module that reports how it was built.
#include <torch/extension.h>
#include <torch/library.h>

#include "megatron_ext_build_config.h"

TORCH_LIBRARY(megatron_ext, m) {
  // The communication regions (ops/mappings.cpp) and the async linear (ops/linear.cpp) declare
  // their schemas beside their kernels, in TORCH_LIBRARY_FRAGMENT blocks.

  // Vocabulary-parallel lookup (kernels/vocab_mask*): local row ids and the ids of other ranks.
  m.def("vocab_range_mask(Tensor ids, int first, int last) -> (Tensor, Tensor)");

  // Vocabulary-parallel cross-entropy (ops/cross_entropy.cpp, kernels/cross_entropy*). The public
  // op is an autograd node over ``_forward`` (kernels + collectives, returns the loss and the row
  // max and log-sum-exp saved for backward); ``_row_stats`` and ``_backward`` are the CPU/CUDA
  // kernels and communicate nothing.
  m.def(
      "vocab_parallel_cross_entropy(Tensor vocab_parallel_logits, Tensor target, "
      "float label_smoothing, int? ignore_index, str group_name) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_forward(Tensor vocab_parallel_logits, Tensor target, "
      "float label_smoothing, int? ignore_index, str group_name) -> (Tensor, Tensor, Tensor)");
  m.def(
      "vocab_parallel_cross_entropy_row_stats(Tensor vocab_parallel_logits, Tensor target, "
      "int vocab_start, int? ignore_index) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_backward(Tensor grad_loss, Tensor vocab_parallel_logits, "
      "Tensor target, Tensor row_max, Tensor log_sum_exp, float label_smoothing, int? ignore_index, "
      "int vocab_start, int vocab_size) -> Tensor");

  // Fused transformer-layer epilogues (ops/fused_epilogue.cpp, kernels/fused_epilogue*). The
  // public ops are autograd nodes over the ``_forward`` / ``_backward`` CPU and CUDA kernels.
  // ``bias_dropout_add`` draws its dropout seed from the device's default generator; the kernels
  // take the (seed, offset) of the Philox stream explicitly.
  m.def("bias_gelu(Tensor input, Tensor bias, bool approximate_tanh) -> Tensor");
  m.def("bias_gelu_forward(Tensor input, Tensor bias, bool approximate_tanh) -> Tensor");
  m.def(
      "bias_gelu_backward(Tensor grad_output, Tensor input, Tensor bias, bool approximate_tanh) -> "
      "Tensor");
  m.def(
      "bias_dropout_add(Tensor input, Tensor? bias, Tensor residual, float prob, bool training) -> "
      "Tensor");
  m.def(
      "bias_dropout_add_forward(Tensor input, Tensor? bias, Tensor residual, float prob, int seed, "
      "int offset) -> Tensor");
  m.def("dropout_backward(Tensor grad_output, float prob, int seed, int offset) -> Tensor");

  // Output layer + vocabulary-parallel cross-entropy over chunks of tokens, never holding the
  // [tokens, vocab / tp] logits (ops/linear_cross_entropy.cpp). ``hidden`` [..., h] is replicated
  // over the group, ``weight`` [vocab / tp, h] is this rank's slice. ``_forward`` returns the loss,
  // the row max and log-sum-exp and, when asked, the gradients for a unit loss gradient;
  // ``_backward`` turns those (or zeros, when not ``precomputed``) into the gradients of
  // ``grad_loss`` in place and sums ``grad_hidden`` over the group.
  m.def(
      "vocab_parallel_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, "
      "float label_smoothing, int? ignore_index, int chunk_size, str group_name, int group_size, "
      "int group_rank) -> Tensor");
  m.def(
      "vocab_parallel_linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor target, "
      "float label_smoothing, int? ignore_index, int chunk_size, bool hidden_grad, bool weight_grad, "
      "str group_name, int group_size, int group_rank) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "vocab_parallel_linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, "
      "Tensor target, Tensor row_max, Tensor log_sum_exp, Tensor(a!) grad_hidden, "
      "Tensor(b!) grad_weight, float label_smoothing, int? ignore_index, int chunk_size, "
      "bool precomputed, int vocab_start, int vocab_size, str group_name, int group_size) -> ()");
}

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = MEGATRON_EXT_BUILT_WITH_TORCH;
#ifdef MEGATRON_EXT_WITH_CUDA
  info["cuda_compiled"] = true;
#else
  info["cuda_compiled"] = false;
#endif
  info["cuda_version"] = MEGATRON_EXT_CUDA_VERSION;
  info["cuda_archs"] = MEGATRON_EXT_CUDA_ARCHS;
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ext C++ extension: ops are registered under torch.ops.megatron_ext";
  m.def("build_info", &build_info,
        "How the extension was built: torch version, whether CUDA was compiled, CUDA archs.");
}
