"""Tensor-parallel layers and the async-all-reduce linear against serial float64 references built
from the same master weights, at tensor-parallel sizes 1, 2 and 4 in one world of 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import ModelParallelConfig
from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from tests.conftest import TIGHT, has_kernel
from tests.distributed import run_distributed

SEQ, BATCH, HIDDEN, OUT, VOCAB, EMBED = 8, 3, 24, 24, 16, 6
WEIGHT_SEED = 1234


def _config(**kwargs) -> ModelParallelConfig:
    return ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float64, **kwargs)


def _master(out_size: int, in_size: int) -> torch.Tensor:
    """The serial weight: what every layer below builds from ``torch.manual_seed(WEIGHT_SEED)``."""
    torch.manual_seed(WEIGHT_SEED)
    weight = torch.empty(out_size, in_size)
    torch.nn.init.xavier_normal_(weight)
    return weight.double()


def _shard(full: torch.Tensor, dim: int, n: int, rank: int, stride: int = 1) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim`` with Megatron's strided (round-robin) layout."""
    per_chunk = full.size(dim) // (n * stride)
    chunks = torch.split(full, per_chunk, dim=dim)
    return torch.cat(chunks[rank::n], dim=dim)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _set_bias(
    layer: torch.nn.Module, full: torch.Tensor, n: int, rank: int, stride: int, column: bool
) -> None:
    with torch.no_grad():
        layer.bias.copy_(_shard(full, 0, n, rank, stride) if column else full)


def _column(n: int, rank: int, *, bias: bool, skip_bias_add: bool, gather_output: bool, stride: int,
            sequence_parallel: bool) -> None:
    torch.manual_seed(WEIGHT_SEED)
    layer = tp_.ColumnParallelLinear(
        HIDDEN,
        OUT,
        config=_config(sequence_parallel=sequence_parallel),
        init_method=torch.nn.init.xavier_normal_,
        bias=bias,
        gather_output=gather_output,
        stride=stride,
        keep_master_weight_for_test=True,
        skip_bias_add=skip_bias_add,
    )
    w = _master(OUT, HIDDEN)
    assert_close(layer.master_weight, w, rtol=0, atol=0)
    assert_close(layer.weight.detach(), _shard(w, 0, n, rank, stride), rtol=0, atol=0)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.weight.partition_stride == stride
    b = _rand(OUT, seed=3)
    if bias:
        assert layer.bias.shape == (OUT // n,) and layer.bias.partition_dim == 0
        _set_bias(layer, b, n, rank, stride, column=True)
    else:
        assert layer.bias is None

    x_full = _rand(SEQ, BATCH, HIDDEN, seed=4)
    g_full = _rand(SEQ, BATCH, OUT, seed=5)
    sp = sequence_parallel and n > 1
    x = (x_full.chunk(n, 0)[rank] if sp else x_full).clone().requires_grad_(True)
    out, out_bias = layer(x)

    y_ref = x_full @ w.T + (b if bias and not skip_bias_add else 0)
    if gather_output:
        assert_close(out, y_ref, **TIGHT)
        out.backward(g_full)
    else:
        assert_close(out, _shard(y_ref, -1, n, rank, stride), **TIGHT)
        out.backward(_shard(g_full, -1, n, rank, stride))
    if skip_bias_add and bias:
        assert out_bias is layer.bias
    else:
        assert out_bias is None

    dx_ref = g_full @ w
    assert_close(x.grad, dx_ref.chunk(n, 0)[rank] if sp else dx_ref, **TIGHT)
    dw_ref = g_full.reshape(-1, OUT).T @ x_full.reshape(-1, HIDDEN)
    assert_close(layer.weight.grad, _shard(dw_ref, 0, n, rank, stride), **TIGHT)
    if bias:
        if skip_bias_add:
            assert layer.bias.grad is None
        else:
            assert_close(layer.bias.grad, _shard(g_full.sum((0, 1)), 0, n, rank, stride), **TIGHT)


def _row(n: int, rank: int, *, bias: bool, skip_bias_add: bool, input_is_parallel: bool, stride: int,
         sequence_parallel: bool) -> None:
    torch.manual_seed(WEIGHT_SEED)
    layer = tp_.RowParallelLinear(
        HIDDEN,
        OUT,
        config=_config(sequence_parallel=sequence_parallel),
        init_method=torch.nn.init.xavier_normal_,
        bias=bias,
        input_is_parallel=input_is_parallel,
        skip_bias_add=skip_bias_add,
        stride=stride,
        keep_master_weight_for_test=True,
    )
    w = _master(OUT, HIDDEN)
    assert_close(layer.master_weight, w, rtol=0, atol=0)
    assert_close(layer.weight.detach(), _shard(w, 1, n, rank, stride), rtol=0, atol=0)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
    sp = sequence_parallel and n > 1
    b = _rand(OUT, seed=6)
    if bias:
        assert layer.bias.shape == (OUT,) and layer.bias.sequence_parallel == sp
        assert tp_.param_is_not_tensor_parallel_duplicate(layer.bias) == (rank == 0)
        _set_bias(layer, b, n, rank, stride, column=False)

    x_full = _rand(SEQ, BATCH, HIDDEN, seed=7)
    g_full = _rand(SEQ, BATCH, OUT, seed=8)
    x = (_shard(x_full, -1, n, rank, stride) if input_is_parallel else x_full).clone().requires_grad_(True)
    out, out_bias = layer(x)

    y_ref = x_full @ w.T + (b if bias and not skip_bias_add else 0)
    assert_close(out, y_ref.chunk(n, 0)[rank] if sp else y_ref, **TIGHT)
    out.backward(g_full.chunk(n, 0)[rank] if sp else g_full)
    assert (out_bias is layer.bias) if (skip_bias_add and bias) else (out_bias is None)

    dx_ref = g_full @ w
    assert_close(x.grad, _shard(dx_ref, -1, n, rank, stride) if input_is_parallel else dx_ref, **TIGHT)
    dw_ref = g_full.reshape(-1, OUT).T @ x_full.reshape(-1, HIDDEN)
    assert_close(layer.weight.grad, _shard(dw_ref, 1, n, rank, stride), **TIGHT)
    if bias and not skip_bias_add:
        # Under sequence parallelism each rank holds the bias gradient of its own tokens only.
        local_g = g_full.chunk(n, 0)[rank] if sp else g_full
        assert_close(layer.bias.grad, local_g.sum((0, 1)), **TIGHT)


def _embedding(n: int, rank: int, *, reduce_scatter_embeddings: bool, deterministic_mode: bool) -> None:
    torch.manual_seed(WEIGHT_SEED)
    layer = tp_.VocabParallelEmbedding(
        VOCAB,
        EMBED,
        init_method=torch.nn.init.xavier_normal_,
        config=_config(deterministic_mode=deterministic_mode),
        reduce_scatter_embeddings=reduce_scatter_embeddings,
    )
    w = _master(VOCAB, EMBED)
    assert_close(layer.weight.detach(), w.chunk(n, 0)[rank], rtol=0, atol=0)
    assert (layer.vocab_start_index, layer.vocab_end_index) == (rank * VOCAB // n, (rank + 1) * VOCAB // n)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    ids[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // 2, 1])  # both ends of the vocabulary
    out = layer(ids)
    ref = w[ids]  # [b, s, h]
    g_full = _rand(SEQ, BATCH, EMBED, seed=10)  # [s, b, h]
    if reduce_scatter_embeddings:
        assert_close(out, ref.transpose(0, 1).chunk(n, 0)[rank], **TIGHT)
        out.backward(g_full.chunk(n, 0)[rank])
        g_bsh = g_full.transpose(0, 1)
    else:
        assert_close(out, ref, **TIGHT)
        g_bsh = g_full.transpose(0, 1).contiguous()
        out.backward(g_bsh)
    dw_ref = torch.zeros(VOCAB, EMBED, dtype=torch.float64).index_add_(
        0, ids.reshape(-1), g_bsh.reshape(-1, EMBED)
    )
    assert_close(layer.weight.grad, dw_ref.chunk(n, 0)[rank], **TIGHT)


def _async_linear(n: int, rank: int) -> None:
    w_full = _rand(OUT, HIDDEN, seed=11)
    w = _shard(w_full, 0, n, rank).clone().requires_grad_(True)
    b = _rand(OUT, seed=12).chunk(n)[rank].clone().requires_grad_(True)
    x_full = _rand(SEQ, BATCH, HIDDEN, seed=13)
    g_full = _rand(SEQ, BATCH, OUT, seed=14)
    dw_ref = g_full.reshape(-1, OUT).T @ x_full.reshape(-1, HIDDEN)

    for sequence_parallel in (False, True):
        sp = sequence_parallel and n > 1
        x = (x_full.chunk(n, 0)[rank] if sp else x_full).clone().requires_grad_(True)
        out = tp_.linear_with_grad_accumulation_and_async_allreduce(
            x,
            w,
            b,
            gradient_accumulation_fusion=False,
            allreduce_dgrad=n > 1 and not sp,
            sequence_parallel=sp,
        )
        assert out.grad_fn is not None
        assert not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction)
        assert "LinearAsyncFunction" in out.grad_fn.name(), out.grad_fn.name()
        assert_close(out, x_full @ w_full.chunk(n, 0)[rank].T + b.detach(), **TIGHT)
        out.backward(g_full.chunk(n, -1)[rank])
        dx_ref = g_full @ w_full
        assert_close(x.grad, dx_ref.chunk(n, 0)[rank] if sp else dx_ref, **TIGHT)
        assert_close(w.grad, dw_ref.chunk(n, 0)[rank], **TIGHT)
        assert_close(b.grad, g_full.sum((0, 1)).chunk(n)[rank], **TIGHT)
        w.grad = b.grad = None

    group_name = ps.get_tensor_model_parallel_group().group_name
    op = torch.ops.megatron_ext.linear_with_grad_accumulation_and_async_allreduce.default
    x = x_full.clone().requires_grad_(True)
    torch.library.opcheck(op, (x, w, b, None, 0, n > 1, False, group_name, n))
    if n > 1:
        x = x_full.chunk(n, 0)[rank].clone().requires_grad_(True)
        torch.library.opcheck(op, (x, w, None, None, 0, False, True, group_name, n))

    # Gradient-accumulation fusion: two backward passes add into main_grad; weight.grad stays None.
    w.main_grad = torch.full_like(w, 0.5)
    for _ in range(2):
        x = x_full.clone().requires_grad_(True)
        out = tp_.linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, gradient_accumulation_fusion=True, allreduce_dgrad=n > 1, sequence_parallel=False
        )
        out.backward(g_full.chunk(n, -1)[rank])
        assert_close(x.grad, g_full @ w_full, **TIGHT)
    assert w.grad is None
    assert_close(w.main_grad, 0.5 + 2 * dw_ref.chunk(n, 0)[rank], **TIGHT)

    # An fp32 main_grad accumulates a float64 weight's gradient in fp32.
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    out = tp_.linear_with_grad_accumulation_and_async_allreduce(
        x_full, w, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False
    )
    out.backward(g_full.chunk(n, -1)[rank])
    assert w.main_grad.dtype == torch.float32
    assert_close(w.main_grad, dw_ref.chunk(n, 0)[rank].float(), rtol=1e-5, atol=1e-5)
    del w.main_grad


def _errors(n: int) -> None:
    init = torch.nn.init.xavier_normal_
    if n > 1:
        with pytest.raises(
            ValueError, match=rf"output_size=9 is not divisible by the tensor-model-parallel size {n}"
        ):
            tp_.ColumnParallelLinear(HIDDEN, 9, config=_config(), init_method=init)
        with pytest.raises(
            ValueError, match=rf"input_size=9 is not divisible by the tensor-model-parallel size {n}"
        ):
            tp_.RowParallelLinear(
                9,
                OUT,
                config=_config(),
                init_method=init,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            )
        with pytest.raises(
            ValueError, match=rf"num_embeddings=15 is not divisible by the tensor-model-parallel size {n}"
        ):
            tp_.VocabParallelEmbedding(15, EMBED, init_method=init, config=_config())
        with pytest.raises(ValueError, match="sequence parallelism needs input_is_parallel=True"):
            tp_.RowParallelLinear(
                HIDDEN,
                OUT,
                config=_config(sequence_parallel=True),
                init_method=init,
                bias=True,
                input_is_parallel=False,
                skip_bias_add=False,
            )
    with pytest.raises(ValueError, match=r"not divisible by stride=5"):
        tp_.ColumnParallelLinear(HIDDEN, OUT, config=_config(), init_method=init, stride=5)
    for build in (
        lambda: tp_.ColumnParallelLinear(HIDDEN, OUT, config=_config(), init_method=None),
        lambda: tp_.RowParallelLinear(HIDDEN, OUT, config=_config(), init_method=None, bias=True,
                                      input_is_parallel=True, skip_bias_add=False),
        lambda: tp_.VocabParallelEmbedding(VOCAB, EMBED, init_method=None, config=_config()),
    ):
        with pytest.raises(ValueError, match="init_method must be a callable"):
            build()
    with pytest.raises(TypeError, match="config must be a configuration object with .* got dict"):
        tp_.ColumnParallelLinear(HIDDEN, OUT, config={}, init_method=init)

    skip = tp_.ColumnParallelLinear(
        HIDDEN, OUT, config=_config(), init_method=None, skip_weight_param_allocation=True
    )
    assert skip.weight is None
    with pytest.raises(RuntimeError, match="skip_weight_param_allocation=True"):
        skip(torch.zeros(2, HIDDEN, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"has shape \(3, 3\), expected \({OUT // n}, {HIDDEN}\)"):
        skip(torch.zeros(2, HIDDEN, dtype=torch.float64), weight=torch.zeros(3, 3, dtype=torch.float64))
    external = torch.randn(OUT // n, HIDDEN, dtype=torch.float64)
    out, _ = skip(torch.ones(2, HIDDEN, dtype=torch.float64), weight=external)
    assert_close(out, torch.ones(2, HIDDEN, dtype=torch.float64) @ external.T + skip.bias.detach(), **TIGHT)

    linear = tp_.linear_with_grad_accumulation_and_async_allreduce
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    with pytest.raises(ValueError, match=r"last dim of the input \(shape \[4, 7\]\) must equal"):
        linear(torch.randn(4, 7), w, None, False, False, False)
    with pytest.raises(ValueError, match=r"bias must have shape \[5\], got \[4\]"):
        linear(x, w, torch.randn(4), False, False, False)
    with pytest.raises(ValueError, match="allreduce_dgrad and sequence_parallel are exclusive"):
        linear(x, w, None, False, True, True)
    with pytest.raises(ValueError, match="needs weight.main_grad"):
        linear(x, w, None, True, False, False)
    with pytest.raises(NotImplementedError, match="grad_output_buffer"):
        linear(x, w, None, False, False, False, grad_output_buffer=[])
    with pytest.raises(NotImplementedError, match="wgrad_deferral_limit=2"):
        linear(x, w, None, False, False, False, wgrad_deferral_limit=2)
    w.main_grad = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"main_grad must be a floating tensor of the weight's shape "
                       r"\[5, 6\], got Float of shape \[2, 2\]"):
        linear(x, w, None, True, False, False)
    w.main_grad = torch.zeros(5, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"floating tensor .* got Long of shape \[5, 6\]"):
        linear(x, w, None, True, False, False)
    op = torch.ops.megatron_ext.linear_with_grad_accumulation_and_async_allreduce
    with pytest.raises(ValueError, match=r"wgrad_placeholder must be 0 \(none\), .* 2 \(zeros\), got 3"):
        op(x, w, None, torch.zeros(5, 6), 3, False, False, "unused", 1)


def _expert_layers() -> None:
    """Megatron-core's experts build their linears with ``is_expert=True``: at tp 1, ep 2 x etp 2
    the layers split over the expert-tensor-parallel group, leave the communication to the token
    dispatcher (no all-reduce of the input gradient, no reduction of the row's output) and mark
    their parameters ``allreduce=False``."""
    ps.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    try:
        group = ps.get_expert_tensor_parallel_group()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        assert ps.get_tensor_model_parallel_world_size() == 1 and dist.get_world_size(group) == 2
        config = _config(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
        torch.manual_seed(WEIGHT_SEED)
        column = tp_.ColumnParallelLinear(
            HIDDEN, OUT, config=config, init_method=torch.nn.init.xavier_normal_, bias=True, is_expert=True
        )
        row = tp_.RowParallelLinear(
            HIDDEN, OUT, config=config, init_method=torch.nn.init.xavier_normal_, bias=True,
            input_is_parallel=True, skip_bias_add=True, is_expert=True,
        )
        master = _master(OUT, HIDDEN)
        torch.manual_seed(WEIGHT_SEED)
        row_weight = tp_.RowParallelLinear(
            HIDDEN, OUT, config=config, init_method=torch.nn.init.xavier_normal_, bias=True,
            input_is_parallel=True, skip_bias_add=True, is_expert=True,
        ).weight
        assert column.tp_group is group and column.explicit_expert_comm and row.explicit_expert_comm
        assert_close(column.weight, _shard(master, 0, 2, etp_rank), **TIGHT)
        assert_close(row_weight, _shard(master, 1, 2, etp_rank), **TIGHT)
        for param in (*column.parameters(), *row.parameters()):
            assert param.allreduce is False
        x = _rand(SEQ, BATCH, HIDDEN, seed=7 + dist.get_rank()).requires_grad_()
        grad = _rand(SEQ, BATCH, OUT // 2, seed=11 + dist.get_rank())
        out, _ = column(x)
        assert_close(out, x @ column.weight.T + column.bias, **TIGHT)
        out.backward(grad)
        assert_close(x.grad, grad @ column.weight, **TIGHT)  # this rank's part only: not all-reduced
        x_part = x.detach()[..., : HIDDEN // 2]
        out, bias = row(x_part)
        assert bias is row.bias
        assert_close(out, x_part @ row.weight.T, **TIGHT)  # the partial product: not reduced
        with pytest.raises(ValueError, match="needs skip_bias_add=True"):
            tp_.RowParallelLinear(
                HIDDEN, OUT, config=config, init_method=torch.nn.init.xavier_normal_, bias=True,
                input_is_parallel=True, skip_bias_add=False, is_expert=True,
            )(x_part)
        # Without expert parallelism an expert layer's parameters are reduced with the others.
        dense = tp_.ColumnParallelLinear(
            HIDDEN, OUT, config=_config(), init_method=torch.nn.init.xavier_normal_, bias=True,
            is_expert=True, tp_group=ps.get_tensor_model_parallel_group(),
        )
        assert dense.weight.allreduce is True and not dense.explicit_expert_comm
    finally:
        ps.destroy_model_parallel()


def _layers_worker() -> None:
    rank = dist.get_rank()
    _expert_layers()
    for n in (1, 2, 4):
        ps.initialize_model_parallel(tensor_model_parallel_size=n)
        try:
            tp_rank = ps.get_tensor_model_parallel_rank()
            assert tp_rank == rank % n
            for bias, skip_bias_add in ((True, False), (False, False), (True, True)):
                _column(n, tp_rank, bias=bias, skip_bias_add=skip_bias_add, gather_output=False, stride=1,
                        sequence_parallel=False)
                _row(n, tp_rank, bias=bias, skip_bias_add=skip_bias_add, input_is_parallel=True, stride=1,
                     sequence_parallel=False)
            _column(
                n,
                tp_rank,
                bias=True,
                skip_bias_add=False,
                gather_output=True,
                stride=1,
                sequence_parallel=False,
            )
            _column(
                n,
                tp_rank,
                bias=True,
                skip_bias_add=False,
                gather_output=False,
                stride=3,
                sequence_parallel=False,
            )
            _column(
                n,
                tp_rank,
                bias=True,
                skip_bias_add=False,
                gather_output=False,
                stride=3,
                sequence_parallel=True,
            )
            _row(
                n,
                tp_rank,
                bias=True,
                skip_bias_add=False,
                input_is_parallel=False,
                stride=1,
                sequence_parallel=False,
            )
            _row(
                n,
                tp_rank,
                bias=True,
                skip_bias_add=False,
                input_is_parallel=True,
                stride=2,
                sequence_parallel=False,
            )
            _row(
                n,
                tp_rank,
                bias=True,
                skip_bias_add=False,
                input_is_parallel=True,
                stride=1,
                sequence_parallel=True,
            )
            for rs in (False, True):
                _embedding(n, tp_rank, reduce_scatter_embeddings=rs, deterministic_mode=False)
            _embedding(n, tp_rank, reduce_scatter_embeddings=False, deterministic_mode=True)
            _async_linear(n, tp_rank)
            _errors(n)
        finally:
            ps.destroy_model_parallel()


@pytest.mark.slow
def test_layers_match_serial_at_tp_1_2_4():
    run_distributed(4, _layers_worker)


def test_model_parallel_config():
    config = ModelParallelConfig()
    assert config.tensor_model_parallel_size == 1 and config.pipeline_model_parallel_size == 1
    assert config.virtual_pipeline_model_parallel_size is None and config.sequence_parallel is False
    assert config.params_dtype == torch.float32 and config.perform_initialization is True
    assert config.use_cpu_initialization is False and config.gradient_accumulation_fusion is False
    assert (
        config.async_tensor_model_parallel_allreduce is True and config.pipeline_dtype is None
    )  # Megatron-core default
    assert config.hidden_size is None and config.deterministic_mode is False
    assert config.variable_seq_lengths is False and config.batch_p2p_comm is True
    assert config.deallocate_pipeline_outputs is False
    assert config.grad_scale_func is None and config.no_sync_func is None
    assert config.finalize_model_grads_func is None and config.timers is None
    assert config.autocast_dtype == torch.float32
    # Sequence parallelism over one rank is accepted (the layers run without it).
    assert ModelParallelConfig(sequence_parallel=True).sequence_parallel is True
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_parallel_size'"):
        ModelParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be an integer >= 1, got 0"):
        ModelParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_dtype is required when pipeline_model_parallel_size is 2"):
        ModelParallelConfig(pipeline_model_parallel_size=2)
    with pytest.raises(TypeError, match="params_dtype must be a torch.dtype"):
        ModelParallelConfig(params_dtype="float32")


def test_linear_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert has_kernel("linear_with_grad_accumulation_and_async_allreduce", "Autograd")
    assert has_kernel("linear_with_grad_accumulation_and_async_allreduce", "Meta")
    import megatron_ext._ops  # noqa: F401

    with FakeTensorMode():
        out = torch.ops.megatron_ext.linear_with_grad_accumulation_and_async_allreduce(
            torch.empty(4, 2, 6), torch.empty(5, 6), None, None, 0, False, False, "unused", 1
        )
        assert out.shape == (4, 2, 5)
