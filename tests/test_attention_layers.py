"""The layers over the attention op: ContextParallelDotProductAttention with TransformerEngine's
``k_channels`` / ``v_channels``, windows on the layers ``window_attn_skip_freq`` picks, sinks and
packed ``thd`` rows, against attention written out in float64; and a GPTModel (rotary, grouped-query
attention, a window, learnable sinks) over a row of packed sequences, padded or not, equal to each
sequence run alone (losses and gradients) at cp 1, and at cp 2 with every comm type."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.models import GPTModel
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.context_parallel import CP_COMM_TYPES, ContextParallelDotProductAttention
from megatron_ext.utils import get_thd_batch_on_this_cp_rank, thd_partitioned_indices
from tests.conftest import TIGHT, Comparisons, assert_comparisons
from tests.distributed import run_distributed
from tests.test_attention_variants import _per_sequence_reference, _reference


def _config(**kwargs) -> TransformerConfig:
    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float64,
                  use_cpu_initialization=True)
    fields.update(kwargs)
    return TransformerConfig(**fields)


SINGLE = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0), cp=None)


def test_core_attention_channels_windows_sinks_and_thd():
    """[s, b, n, k] queries and keys, [s, b, n, v] values in, [s, b, n * v] out; the window on
    layers 1 and 3 of 4 (window_attn_skip_freq 2), learnable sinks; thd rows [t, n, ·]."""
    torch.manual_seed(0)
    config = _config(window_size=(4, 0), window_attn_skip_freq=2, softmax_type="learnable")
    s, b, k_dim, v_dim = 20, 2, 12, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, 4, k_dim, generator=g, dtype=torch.float64)
    k = torch.randn(s, b, 2, k_dim, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, 2, v_dim, generator=g, dtype=torch.float64)
    grad = torch.randn(s, b, 4 * v_dim, generator=g, dtype=torch.float64)
    for layer, window in ((1, 5), (2, None), (3, 5)):
        attention = ContextParallelDotProductAttention(
            config, layer, "causal", "self", k_channels=k_dim, v_channels=v_dim, pg_collection=SINGLE
        )
        assert list(attention.state_dict()) == ["softmax_offset"]
        assert attention.softmax_offset.shape == (4,) and attention.softmax_offset.tensor_model_parallel
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, attention_mask=None)
        out.backward(grad)
        expected = _reference(
            *(t.permute(1, 2, 0, 3) for t in (q, k, v)),
            grad.view(s, b, 4, v_dim).permute(1, 2, 0, 3),
            window=window,
            sinks=attention.softmax_offset.detach(),
        )
        torch.testing.assert_close(out, expected[0].permute(2, 0, 1, 3).reshape(s, b, -1), **TIGHT)
        for leaf, ref in zip(leaves, expected[1:4]):
            torch.testing.assert_close(leaf.grad, ref.permute(2, 0, 1, 3), **TIGHT)
        torch.testing.assert_close(attention.softmax_offset.grad, expected[4], **TIGHT)
    # A packed row handed over as Megatron-core's attention does for thd: [t, n, ·], batch squeezed.
    bounds = [0, 6, 9, 20]
    cu = torch.tensor(bounds, dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11)
    attention = ContextParallelDotProductAttention(
        config, 1, "causal", "self", k_channels=k_dim, v_channels=v_dim, pg_collection=SINGLE
    )
    out = attention(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=packed)
    expected = _per_sequence_reference(
        *(t[:, :1].permute(1, 2, 0, 3) for t in (q, k, v)), torch.zeros(1, 4, s, v_dim, dtype=torch.float64),
        bounds, window=5, sinks=attention.softmax_offset.detach(),
    )[0]
    torch.testing.assert_close(out, expected[0].permute(1, 0, 2).reshape(s, -1), **TIGHT)


def test_core_attention_refusals():
    config = _config(window_size=(4, 0))
    with pytest.raises(ValueError, match="slides over causal attention; attn_mask_type is 'no_mask'"):
        ContextParallelDotProductAttention(config, 1, "no_mask", "self", pg_collection=SINGLE)
    attention = ContextParallelDotProductAttention(_config(), 1, "no_mask", "self", pg_collection=SINGLE)
    x = torch.zeros(8, 4, 8, dtype=torch.float64)
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8]),
                             cu_seqlens_q_padded=torch.tensor([0, 4, 8]))
    with pytest.raises(NotImplementedError, match="padding .* need the causal mask"):
        attention(x, x, x, None, packed_seq_params=padded)
    with pytest.raises(NotImplementedError, match="qkv_format='sbhd'"):
        attention(x, x, x, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        _config(softmax_type="sigmoid")
    with pytest.raises(ValueError, match="window_attn_skip_freq must be a positive int"):
        _config(window_size=(4, 0), window_attn_skip_freq=[1, 0])
    with pytest.raises(ValueError, match=r"window_size=\(4, 4\): the right side must be 0"):
        _config(window_size=(4, 4))


# --- GPTModel over packed rows ------------------------------------------------------------------

VOCAB = 64
# Three sequences; padded to a multiple of 2 * cp = 4 tokens each for cp 2 (the row's layout).
LENGTHS = [7, 12, 5]


def _gpt(cp: int = 1, comm: str = "p2p") -> GPTModel:
    config = _config(
        context_parallel_size=cp, cp_comm_type=comm, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, ffn_hidden_size=64,
        window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable",
    )
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=64, init_seed=5,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _sequences():
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, VOCAB, (1, n), generator=g), torch.randint(0, VOCAB, (1, n), generator=g))
            for n in LENGTHS]


def _alone(model: GPTModel, sequences) -> tuple[list[torch.Tensor], dict]:
    """Each sequence through the model on its own: per-token losses and the summed gradients."""
    model.zero_grad()
    losses = []
    for tokens, labels in sequences:
        loss = model(tokens, None, labels=labels)
        loss.sum().backward()
        losses.append(loss.detach()[0])
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed_row(sequences, pad_to: int):
    """The sequences packed in one row, each padded to a multiple of ``pad_to`` (padding labels
    -1), with Megatron-core's cu_seqlens / cu_seqlens_padded / max_seqlen."""
    tokens, labels, real, padded = [], [], [0], [0]
    for t, lab in sequences:
        n = t.shape[1]
        extra = -n % pad_to
        tokens.append(torch.cat([t[0], torch.zeros(extra, dtype=t.dtype)]))
        labels.append(torch.cat([lab[0], torch.full((extra,), -1, dtype=lab.dtype)]))
        real.append(real[-1] + n)
        padded.append(padded[-1] + n + extra)
    longest = torch.tensor([max(b - a for a, b in zip(padded, padded[1:]))])
    return (torch.cat(tokens)[None], torch.cat(labels)[None], torch.tensor(real, dtype=torch.int32),
            torch.tensor(padded, dtype=torch.int32), longest)


def _packed_losses(model: GPTModel, tokens, labels, packed: PackedSeqParams) -> torch.Tensor:
    """The packed row's per-token losses (padding tokens' zeroed) with their sum's gradients."""
    model.zero_grad()
    loss = model(tokens, None, labels=labels.clamp(min=0), packed_seq_params=packed)[0]
    loss = loss.masked_fill(labels[0] < 0, 0.0)
    loss.sum().backward()
    return loss.detach()


def _packed_worker(cp: int) -> list:
    """cp 1: unpadded and padded packing (padding after each sequence's tokens, unseen under the
    causal mask), rotary positions restarting with each sequence. cp 2: every comm type, each
    sequence split into 2 * cp chunks on its own (get_thd_batch_on_this_cp_rank); the ranks'
    losses are the serial ones of their rows, their gradients sum to the serial ones."""
    cmp = Comparisons()
    sequences = _sequences()
    ps.initialize_model_parallel()
    model = _gpt()
    expected, expected_grads = _alone(model, sequences)
    if cp == 1:
        for pad_to in (1, 4):
            tokens, labels, real, padded, longest = _packed_row(sequences, pad_to)
            packed = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                cu_seqlens_kv_padded=padded, max_seqlen_q=int(longest), max_seqlen_kv=int(longest),
            )
            losses = _packed_losses(model, tokens, labels, packed)
            cmp.close(losses[labels[0] >= 0], torch.cat(expected), f"padded to {pad_to} losses", **TIGHT)
            for name, param in model.named_parameters():
                cmp.close(param.grad, expected_grads[name], f"padded to {pad_to} {name}", **TIGHT)
        ps.destroy_model_parallel()
        return cmp.made
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=cp)
    rank = ps.get_context_parallel_rank()
    tokens, labels, real, padded, longest = _packed_row(sequences, 2 * cp)
    # The serial per-token losses laid out as the packed row (padding: 0), then this rank's rows.
    row = torch.zeros(labels.shape[1], dtype=torch.float64)
    row[labels[0] >= 0] = torch.cat(expected)
    mine = row[thd_partitioned_indices(padded, row.numel(), cp, rank)]
    for comm in CP_COMM_TYPES:
        model = _gpt(cp, comm)
        batch, packed = get_thd_batch_on_this_cp_rank(
            {"tokens": tokens.clone(), "labels": labels.clone()}, real, padded, longest
        )
        losses = _packed_losses(model, batch["tokens"], batch["labels"], packed)
        cmp.close(losses, mine, f"{comm} rank {rank} losses", **TIGHT)
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=ps.get_context_parallel_group())  # the cp ranks' parts
            cmp.close(grad, expected_grads[name], f"{comm} rank {rank} {name}", **TIGHT)
    ps.destroy_model_parallel()
    return cmp.made


def test_gpt_packed_row_equals_sequences_alone():
    (made,) = run_distributed(1, _packed_worker, 1)
    assert_comparisons(made)


@pytest.mark.slow  # 2 ranks, a model per comm type
def test_gpt_packed_row_at_cp2_equals_sequences_alone():
    for made in run_distributed(2, _packed_worker, 2):
        assert_comparisons(made)


def _refusal_worker() -> list[str]:
    """megatron_ext's attention with a window or sinks: the op is causal and has no dropout."""
    from megatron_ext.transformer import ParallelAttention

    ps.initialize_model_parallel()
    messages = []
    cases = [(dict(window_size=(3, 0)), True), (dict(softmax_type="off-by-one", attention_dropout=0.1), 0)]
    for kwargs, mask in cases:
        attention = ParallelAttention(_config(**kwargs))
        try:
            attention(torch.randn(8, 1, 32, dtype=torch.float64),
                      attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool) if mask else None)
        except (ValueError, NotImplementedError) as e:
            messages.append(f"{type(e).__name__}: {e}")
        else:
            messages.append("no error")
    ps.destroy_model_parallel()
    return messages


def test_attention_refuses_a_mask_or_dropout_with_the_op():
    ((mask, dropout),) = run_distributed(1, _refusal_worker)
    assert mask.startswith("ValueError: ParallelAttention: sliding windows run in the causal attention op, "
                           "which takes no attention_mask"), mask
    assert dropout.startswith("NotImplementedError: ParallelAttention: attention_dropout=0.1 with attention "
                              "sinks is not supported"), dropout


def _sharded_sinks_worker() -> dict:
    ps.initialize_model_parallel(2)
    config = _config(num_layers=2, tensor_model_parallel_size=2, softmax_type="learnable")
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model = GPTModel(config, vocab_size=64, max_sequence_length=16, init_seed=1)
    shards = {t.key: (t.global_shape, t.global_offset, tuple(t.data.shape))
              for name, t in model.sharded_state_dict().items() if "softmax_offset" in name}
    ps.destroy_model_parallel()
    return shards


def test_learnable_sinks_checkpoint_as_megatron_core():
    """The sinks of a tp 2 model: Megatron-core's key, stacked over layers, split along the heads."""
    for rank, shards in enumerate(run_distributed(2, _sharded_sinks_worker)):
        key = "decoder.layers.self_attention.core_attention.softmax_offset"
        assert sorted(shards) == [key], shards
        assert shards[key][0] == (2, 4) and shards[key][1][1] == 2 * rank and shards[key][2] == (2,), shards


def _compiled_worker() -> list:
    """megatron_ext's attention with a window and learnable sinks compiled with fullgraph (the op's
    fake kernels, its outputs' strides), and over a packed row compiled with graph breaks (the
    boundaries are read on the host), against eager."""
    from megatron_ext.transformer import ParallelAttention

    cmp = Comparisons()
    ps.initialize_model_parallel()
    attention = ParallelAttention(_config(window_size=(2, 0), softmax_type="learnable"))
    bounds = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=7)
    x = torch.randn(12, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for fullgraph, params in ((True, None), (False, packed)):
        results = []
        for module in (attention, torch.compile(attention, fullgraph=fullgraph)):
            leaf = x.clone().requires_grad_(True)
            out = module(leaf, packed_seq_params=params)[0]
            out.square().sum().backward()
            grads = {name: p.grad.clone() for name, p in attention.named_parameters() if p.grad is not None}
            results.append({"out": out, "input grad": leaf.grad, **grads})
            attention.zero_grad(set_to_none=True)
        assert list(results[1]) == list(results[0]) and "softmax_offset" in results[0], list(results[0])
        for name, want in results[0].items():
            cmp.close(results[1][name], want, f"fullgraph={fullgraph} {name}", **TIGHT)
    ps.destroy_model_parallel()
    return cmp.made


@pytest.mark.slow  # compiles the layer
def test_attention_with_window_sinks_and_packing_compiles():
    (made,) = run_distributed(1, _compiled_worker, timeout=900)
    assert_comparisons(made)
