// The library's one schema block (every op's schema; the ops/ and kernels/ files register their
// implementations in TORCH_LIBRARY_IMPL blocks), and the Python module that reports how it was
// built.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <string>

#include "datasets/helpers.h"
#include "kernels/cpu_capability.h"
#include "kernels/cross_entropy_checks.h"
#include "megatron_ext_build_config.h"

TORCH_LIBRARY(megatron_ext, m) {
  // The conjugate communication regions (ops/mappings.cpp): autograd nodes whose forward and
  // backward are a collective over the group named ``group_name`` (or none), returning a view of
  // ``input`` where the collective is the identity.
  for (const char* region :
       {"copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
        "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
        "scatter_to_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
        "all_gather_last_dim_from_tensor_parallel_region",
        "reduce_scatter_last_dim_to_tensor_parallel_region"}) {
    m.def((std::string(region) +
           "(Tensor(a) input, str group_name, int group_size, int rank) -> Tensor(a)")
              .c_str());
  }
  m.def(
      "gather_from_sequence_parallel_region(Tensor(a) input, bool tensor_parallel_output_grad, "
      "str group_name, int group_size, int rank) -> Tensor(a)");

  // The linear whose backward overlaps the input-gradient collective with the weight-gradient
  // GEMM (ops/linear.cpp, ops/weight_grad.cpp).
  m.def(
      "linear_with_grad_accumulation_and_async_allreduce(Tensor input, Tensor weight, Tensor? "
      "bias, Tensor? main_grad, int wgrad_placeholder, bool allreduce_dgrad, "
      "bool sequence_parallel, str group_name, int group_size) -> Tensor");

  // Vocabulary-parallel lookup (kernels/vocab_mask*): local row ids and the ids of other ranks.
  m.def("vocab_range_mask(Tensor ids, int first, int last) -> (Tensor, Tensor)");

  // Vocabulary-parallel cross-entropy (ops/cross_entropy.cpp, kernels/cross_entropy*). The public
  // op is an autograd node over ``_forward`` (kernels + collectives: returns the loss, the row max
  // and log-sum-exp saved for backward, and each token's target column in this rank's vocabulary
  // slice, -1 when another rank holds it, -2 when ignored). ``group_size`` is checked against the
  // group at run time, so a compiled graph names the size it was traced for; the rank-dependent
  // slice is found at run time. ``_row_stats`` and ``_backward`` are the CPU/CUDA kernels and
  // communicate nothing; ``_backward_`` writes the gradient over the logits (overwrite_logits).
  m.def(
      "vocab_parallel_cross_entropy(Tensor vocab_parallel_logits, Tensor target, "
      "float label_smoothing, int? ignore_index, str group_name, int group_size, "
      "bool overwrite_logits=False) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_forward(Tensor vocab_parallel_logits, Tensor target, "
      "float label_smoothing, int? ignore_index, str group_name, int group_size) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "vocab_parallel_cross_entropy_row_stats(Tensor vocab_parallel_logits, Tensor target, "
      "int vocab_start, int? ignore_index) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_backward(Tensor grad_loss, Tensor vocab_parallel_logits, "
      "Tensor local_target, Tensor row_max, Tensor log_sum_exp, float label_smoothing, int "
      "vocab_size) "
      "-> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_backward_(Tensor grad_loss, Tensor(a!) vocab_parallel_logits, "
      "Tensor local_target, Tensor row_max, Tensor log_sum_exp, float label_smoothing, int "
      "vocab_size) "
      "-> ()");

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

  // Fused RMSNorm, rotary embedding and SwiGLU of the Llama family (ops/llama_fusions.cpp,
  // kernels/llama_fusions*). The public ops are autograd nodes over the ``_forward`` /
  // ``_backward`` CPU and CUDA kernels. ``rms_norm_forward`` also returns the per-row rstd
  // (float32 for 16-bit inputs) its backward takes; the rotary kernels take the cos and sin
  // tables [s, d_rot] in the input's dtype, which ``rotary_pos_emb`` computes from freqs
  // [s, 1, 1, d_rot]; ``swiglu``'s input holds (gate, up) as the halves of its last dim, and it
  // computes gate sigmoid(alpha gate) (up + linear_offset) of the halves (clamped by clamp_value:
  // the gate above, the linear half both ways), SwiGLU with the defaults.
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_forward(Tensor input, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor rstd) -> "
      "(Tensor, Tensor)");
  m.def("rotary_pos_emb(Tensor t, Tensor freqs, bool interleaved) -> Tensor");
  m.def("rotary_pos_emb_forward(Tensor t, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  m.def(
      "rotary_pos_emb_backward(Tensor grad_output, Tensor cos, Tensor sin, bool interleaved) -> "
      "Tensor");
  m.def(
      "swiglu(Tensor input, Tensor? bias, float alpha=1.0, float linear_offset=0.0, "
      "float? clamp_value=None) -> Tensor");
  m.def(
      "swiglu_forward(Tensor input, Tensor? bias, float alpha=1.0, float linear_offset=0.0, "
      "float? clamp_value=None) -> Tensor");
  m.def(
      "swiglu_backward(Tensor grad_output, Tensor input, Tensor? bias, float alpha=1.0, "
      "float linear_offset=0.0, float? clamp_value=None) -> Tensor");

  // The short depthwise causal convolution of Mamba-2 and Gated DeltaNet layers
  // (ops/causal_conv1d.cpp, kernels/causal_conv1d*): x [B, D, L], weight [D, W], bias [D];
  // y = act(bias + sum_k weight[:, k] x[t - W + 1 + k]), restarting at each sequence of
  // cu_seqlens (B = 1), the inputs before a start taken from initial_states [B or sequences, D,
  // W - 1] (zero without). The public op is an autograd node over the ``_forward`` / ``_backward``
  // CPU and CUDA kernels; the backward returns the gradients of x, the weight, the bias (also
  // without a bias) and the initial states (shape [0] without them).
  m.def(
      "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, Tensor? cu_seqlens=None, "
      "Tensor? initial_states=None, str activation=\"none\") -> Tensor");
  m.def(
      "causal_conv1d_forward(Tensor x, Tensor weight, Tensor? bias, Tensor? cu_seqlens, "
      "Tensor? initial_states, str activation) -> Tensor");
  m.def(
      "causal_conv1d_backward(Tensor grad_output, Tensor x, Tensor weight, Tensor? bias, "
      "Tensor? cu_seqlens, Tensor? initial_states, str activation) -> "
      "(Tensor, Tensor, Tensor, Tensor)");

  // The gated delta rule of Gated DeltaNet layers (ops/gated_delta_rule.cpp,
  // kernels/gated_delta_rule*): q, k [B, T, H, K], v [B, T, H, V], g (log decay), beta [B, T, H];
  // per (b, h) the state S [K, V] runs S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - e^{g_t}
  // S_{t-1}^T k_t))^T and o_t = S_t^T (scale q_t),
  // q and k optionally L2-normalised, restarting at each sequence of cu_seqlens (B = 1) from
  // initial_state [B or sequences, H, K, V] (zero without). The public op is an autograd node over
  // the ``_forward`` / ``_backward`` CPU and CUDA kernels, computed a chunk at a time; the forward
  // kernel also returns the state entering each chunk [B, H, chunks, K, V], which the backward
  // reads. Without output_final_state the second output is an empty tensor.
  m.def(
      "chunk_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
      "float? scale=None, Tensor? initial_state=None, bool output_final_state=False, "
      "Tensor? cu_seqlens=None, bool use_qk_l2norm=False, int chunk_size=64) -> (Tensor, Tensor)");
  m.def(
      "gated_delta_rule_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
      "Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm, int chunk_size) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "gated_delta_rule_backward(Tensor grad_output, Tensor? grad_final_state, Tensor q, "
      "Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
      "Tensor? cu_seqlens, Tensor chunk_states, bool use_qk_l2norm, int chunk_size) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");

  // The Mamba-2 SSD scan (ops/mamba_ssd.cpp, kernels/mamba_ssd*): x [B, L, H, P], dt [B, L, H],
  // A [H], B and C [B, L, G, N]; per head, state S_t = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T and
  // y_t = (S_t C_t + D x_t) * silu(z_t), dt' = clamp(softplus?(dt + dt_bias), dt_min, dt_max),
  // restarting at each sequence of cu_seqlens (B = 1) from initial_states [B or sequences, H, P,
  // N] (zero without); returns y and the final states. The public op is an autograd node over the
  // ``_forward`` kernel (which also returns the states at the chunk starts, all the backward
  // keeps) and the ``_backward`` kernel (the gradients of x, dt, A, B, C, D, z, dt_bias and the
  // initial states; shape [0] for an absent one).
  m.def(
      "mamba_chunk_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, int chunk_size, "
      "Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, Tensor? initial_states=None, "
      "Tensor? cu_seqlens=None, bool dt_softplus=False, float dt_min=0.0, float? dt_max=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "mamba_chunk_scan_forward(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, int chunk_size, "
      "Tensor? D, Tensor? z, Tensor? dt_bias, Tensor? initial_states, Tensor? cu_seqlens, "
      "bool dt_softplus, float dt_min, float? dt_max) -> (Tensor, Tensor, Tensor)");
  m.def(
      "mamba_chunk_scan_backward(Tensor grad_y, Tensor? grad_final_states, Tensor x, Tensor dt, "
      "Tensor A, Tensor B, Tensor C, int chunk_size, Tensor? D, Tensor? z, Tensor? dt_bias, "
      "Tensor? initial_states, Tensor? cu_seqlens, bool dt_softplus, float dt_min, "
      "float? dt_max, Tensor chunk_states) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor)");

  // The experts' token permutation (ops/moe.cpp, kernels/moe_permute*). ``moe_sort_by_expert``
  // returns the token and the expert of each permuted row, expert-major (with ``capacity``: that
  // many rows per expert, padded with tokens the expert was not sent). ``moe_permute`` gathers the
  // rows of ``sorted_indices`` (times ``probs``), ``moe_unpermute`` adds rows (times ``probs``)
  // back into ``num_tokens`` tokens: autograd nodes over the CPU and CUDA kernels
  // ``moe_gather_rows``,
  // ``moe_scatter_add_rows`` and ``moe_gathered_row_dot`` (the probabilities' gradient).
  m.def("moe_sort_by_expert(Tensor routing_map, int? capacity) -> (Tensor, Tensor)");
  m.def("moe_permute(Tensor tokens, Tensor sorted_indices, Tensor? probs) -> Tensor");
  m.def(
      "moe_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs, int num_tokens) "
      "-> Tensor");
  m.def("moe_gather_rows(Tensor input, Tensor indices, Tensor? scale) -> Tensor");
  m.def(
      "moe_scatter_add_rows(Tensor input, Tensor indices, Tensor? scale, int num_rows) -> Tensor");
  m.def("moe_gathered_row_dot(Tensor grad, Tensor indices, Tensor input) -> Tensor");

  // The experts' grouped GEMM (ops/moe.cpp): ``a``'s rows grouped by expert (``batch_sizes``, a CPU
  // tensor) times each expert's matrix of ``b``; a loop of GEMMs, its backward one op too.
  m.def("grouped_gemm(Tensor a, Tensor b, Tensor batch_sizes, bool trans_b) -> Tensor");
  m.def(
      "grouped_gemm_backward(Tensor grad, Tensor a, Tensor b, Tensor batch_sizes, bool trans_b) -> "
      "(Tensor, Tensor)");

  // ``output`` unchanged; its backward gives ``aux_loss`` the gradient ``scale``, read when the
  // backward runs (ops/moe.cpp): an auxiliary loss joining the main loss's backward.
  m.def("moe_aux_loss_scaler(Tensor(a) output, Tensor aux_loss, Tensor scale) -> Tensor(a)");

  // The all-to-all along dim 0 of expert parallelism, uneven splits given (ops/all_to_all.cpp).
  m.def(
      "all_to_all(Tensor(a) input, int[]? output_split_sizes, int[]? input_split_sizes, "
      "str group_name, int group_size, int rank) -> Tensor(a)");

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
      "float label_smoothing, int? ignore_index, int chunk_size, bool hidden_grad, bool "
      "weight_grad, "
      "str group_name, int group_size, int group_rank) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "vocab_parallel_linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor "
      "weight, "
      "Tensor target, Tensor row_max, Tensor log_sum_exp, Tensor(a!) grad_hidden, "
      "Tensor(b!) grad_weight, float label_smoothing, int? ignore_index, int chunk_size, "
      "bool precomputed, int vocab_start, int vocab_size, str group_name, int group_size) -> ()");

  // Context-parallel attention (ops/context_parallel_attention.cpp): query [b, heads, s, d], key
  // [b, groups, s, d] and value [b, groups, s, dv], this rank's tokens; returns [b, heads, s, dv].
  // ``window``: the keys a causal query sees, itself included; ``sinks``: one logit per head;
  // ``cu_seqlens``: the boundaries of packed sequences on the whole row. ``_forward`` also returns
  // the log-sum-exp its backward takes; ``_backward`` the sinks' gradient (empty without sinks).
  m.def(
      "context_parallel_attention(Tensor query, Tensor key, Tensor value, str group_name, "
      "int group_size, int group_rank, bool is_causal=True, str cp_comm_type=\"p2p\", "
      "float? scale=None, int? window=None, Tensor? sinks=None, Tensor? cu_seqlens=None) "
      "-> Tensor");
  m.def(
      "context_parallel_attention_forward(Tensor query, Tensor key, Tensor value, str group_name, "
      "int group_size, int group_rank, bool is_causal, str cp_comm_type, float? scale, "
      "int? window=None, Tensor? sinks=None, Tensor? cu_seqlens=None) -> (Tensor, Tensor)");
  m.def(
      "context_parallel_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor "
      "value, Tensor out, Tensor log_sum_exp, str group_name, int group_size, int group_rank, "
      "bool is_causal, str cp_comm_type, float? scale, int? window=None, Tensor? sinks=None, "
      "Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor, Tensor)");
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
  info["cpu_capabilities"] = megatron_ext::kernels::compiled_cpu_capabilities();
  info["cpu_capability"] =
      megatron_ext::kernels::cpu_capability_name(megatron_ext::kernels::cpu_capability());
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ext C++ extension: ops are registered under torch.ops.megatron_ext";
  m.def(
      "build_info", &build_info,
      "How the extension was built: torch version, whether CUDA was compiled, CUDA archs, the CPU "
      "instruction sets the CPU kernels were compiled for and the one in use.");
  m.def(
      "cpu_capability",
      [] {
        return megatron_ext::kernels::cpu_capability_name(megatron_ext::kernels::cpu_capability());
      },
      "The instruction set the CPU kernels use: default, avx2 or avx512.");
  m.def("supported_cpu_capabilities", &megatron_ext::kernels::supported_cpu_capabilities,
        "The compiled instruction sets the running CPU supports.");
  m.def("_set_cpu_capability", &megatron_ext::kernels::set_cpu_capability,
        "Forces the CPU kernels' instruction set (for tests); ValueError if the CPU or build lacks "
        "it.");

  // What the cross-entropy's fake kernels (megatron_ext/_ops.py) read from kernels/cross_entropy.h.
  m.def("cross_entropy_acc_dtype", &megatron_ext::cross_entropy_acc_type,
        "The dtype of the cross-entropy's row statistics and losses for logits of a given dtype.");
  m.attr("CROSS_ENTROPY_ROW_STATS") = static_cast<int64_t>(megatron_ext::kernels::kNumRowStats);
  m.attr("CROSS_ENTROPY_TARGET_ELSEWHERE") = megatron_ext::kernels::kTargetElsewhere;
  m.attr("CROSS_ENTROPY_IGNORED_TOKEN") = megatron_ext::kernels::kIgnoredToken;

  // The index builders of megatron_ext.datasets (csrc/datasets/helpers.cpp).
  megatron_ext::datasets::register_helpers(m);
}
