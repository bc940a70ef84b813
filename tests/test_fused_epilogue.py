"""The fused epilogue ops on CPU (the twins of the CUDA kernels): each equals the unfused torch
composition forward and backward, dropout replays under recomputation, and the transformer layer
with the fusion flags on equals it with them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import megatron_ext  # noqa: F401
from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.fusions import bias_gelu, get_bias_dropout_add
from tests.conftest import EXACT, Comparisons, assert_comparisons, grads_of, has_kernel
from tests.distributed import run_distributed

ops = torch.ops.megatron_ext
LOOSE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(dtype: torch.dtype, shape=(5, 3, 24), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, b, r, grad


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_bias_gelu_equals_unfused(approximate, dtype):
    x, b, _, grad = _inputs(dtype)
    fused = bias_gelu(x, b, approximate)
    # The reference runs in float64 from the same (rounded) inputs: the fused kernel adds the bias
    # and evaluates the GeLU in its accumulation type without rounding in between.
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = F.gelu(x64 + b64, approximate=approximate)
    tol = EXACT if dtype == torch.float64 else LOOSE[dtype]
    assert fused.dtype == dtype
    assert_close(fused.double(), ref, **tol)
    for got, want in zip(grads_of(fused, grad, x, b), grads_of(ref, grad.double(), x64, b64)):
        assert got.dtype == dtype
        # The bias gradient sums 15 rows: its rounding in 16 bits grows with the sum.
        assert_close(got.double(), want, **(tol if dtype != torch.bfloat16 else dict(rtol=4e-2, atol=6e-2)))


def _mask_scale(shape, prob: float, state: torch.Tensor) -> torch.Tensor:
    """The mask times 1 / (1 - prob) the fused op draws from CPU generator state ``state``."""
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        ones = torch.ones(shape, dtype=torch.float64)
        return ops.bias_dropout_add(ones, None, torch.zeros_like(ones), prob, True)
    finally:
        torch.set_rng_state(saved)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_equals_unfused(dtype, with_bias):
    prob = 0.3
    x, b, r, grad = _inputs(dtype, shape=(7, 3, 33))  # numel not a multiple of the Philox group
    bias = b if with_bias else None
    state = torch.get_rng_state()
    fused = get_bias_dropout_add(True, True)((x, bias), r, prob)
    mask_scale = _mask_scale(x.shape, prob, state)
    kept = (mask_scale != 0).double().mean().item()
    assert abs(kept - (1 - prob)) < 0.08, kept
    assert set(mask_scale.unique().tolist()) == {0.0, 1.0 / (1 - prob)}

    x64, b64, r64 = (t.detach().double().requires_grad_() for t in (x, b, r))
    ref = r64 + ((x64 + b64) if with_bias else x64) * mask_scale
    tol = EXACT if dtype == torch.float64 else LOOSE[dtype]
    assert_close(fused.double(), ref, **tol)
    inputs, refs = ([x, b, r], [x64, b64, r64]) if with_bias else ([x, r], [x64, r64])
    for got, want in zip(grads_of(fused, grad, *inputs), grads_of(ref, grad.double(), *refs)):
        assert_close(got.double(), want, **(tol if dtype != torch.bfloat16 else dict(rtol=4e-2, atol=6e-2)))

    # The generator moved on: the next call draws another mask.
    again = get_bias_dropout_add(True, True)((x, bias), r, prob)
    assert not torch.equal(again, fused)


@pytest.mark.parametrize("training,prob", [(False, 0.3), (True, 0.0)])
def test_bias_dropout_add_without_dropout_is_the_sum_and_draws_nothing(training, prob):
    x, b, r, grad = _inputs(torch.float64)
    state = torch.get_rng_state()
    fused = get_bias_dropout_add(training, True)((x, b), r, prob)
    assert torch.equal(torch.get_rng_state(), state)
    unfused = get_bias_dropout_add(training, False)((x, b), r, prob)
    assert_close(fused, unfused, **EXACT)
    for got, want in zip(grads_of(fused, grad, x, b, r), grads_of(unfused, grad, x, b, r)):
        assert_close(got, want, **EXACT)


def test_dropout_under_recomputation_equals_without():
    """Activation checkpointing replays the CPU generator, so the recomputed forward drops the same
    elements and the gradients equal those of the run that kept its activations."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 24, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 2, 24, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(6, 2, 24, generator=g, dtype=torch.float64)

    def block(h: torch.Tensor) -> torch.Tensor:
        h = ops.bias_dropout_add(h @ w.t(), b, h, 0.4, True)
        return ops.bias_dropout_add(bias_gelu(h, b) @ w.t(), None, h, 0.4, True)

    def grads_after_backward(out: torch.Tensor) -> list[torch.Tensor]:
        out.backward(grad)  # checkpointing needs .backward(), not autograd.grad
        result = [t.grad.clone() for t in (x, w, b)]
        for t in (x, w, b):
            t.grad = None
        return result

    state = torch.get_rng_state()
    plain = block(x)
    plain_grads = grads_after_backward(plain)
    torch.set_rng_state(state)
    recomputed = tensor_parallel.checkpoint(block, False, x)
    assert_close(recomputed, plain, **EXACT)
    for got, want in zip(grads_after_backward(recomputed), plain_grads):
        assert_close(got, want, **EXACT)


def test_kernels_cpu_twin_contract_and_opcheck():
    x, b, r, grad = _inputs(torch.float64)
    x, b, r = x.detach(), b.detach(), r.detach()
    # The same (seed, offset) gives the same mask; the backward kernel regenerates it.
    out = ops.bias_dropout_add_forward(x, b, r, 0.25, 1234, 8)
    assert torch.equal(out, ops.bias_dropout_add_forward(x, b, r, 0.25, 1234, 8))
    mask_scale = ops.bias_dropout_add_forward(torch.ones_like(x), None, torch.zeros_like(x), 0.25, 1234, 8)
    assert_close(out, r + (x + b) * mask_scale, **EXACT)
    assert_close(ops.dropout_backward(grad, 0.25, 1234, 8), grad * mask_scale, **EXACT)
    assert not torch.equal(out, ops.bias_dropout_add_forward(x, b, r, 0.25, 1234, 9))
    # A shifted offset continues the stream: group k of offset 8 is group k - 1 of offset 9.
    shifted = ops.bias_dropout_add_forward(torch.ones_like(x), None, torch.zeros_like(x), 0.25, 1234, 9)
    assert torch.equal(mask_scale.flatten()[4:], shifted.flatten()[:-4])
    assert torch.equal(ops.bias_dropout_add_forward(x, b, r, 1.0, 5, 0), r)

    xg, bg, rg = (t.clone().requires_grad_() for t in (x, b, r))
    torch.library.opcheck(ops.bias_gelu.default, (xg, bg, False))
    torch.library.opcheck(ops.bias_gelu.default, (xg, bg, True))
    torch.library.opcheck(ops.bias_gelu_forward.default, (x, b, True))
    torch.library.opcheck(ops.bias_gelu_backward.default, (grad, x, b, False))
    torch.library.opcheck(ops.bias_dropout_add.default, (xg, bg, rg, 0.1, False))
    torch.library.opcheck(ops.bias_dropout_add.default, (xg, None, rg, 0.0, True))
    torch.library.opcheck(ops.bias_dropout_add_forward.default, (x, b, r, 0.5, 7, 0))
    torch.library.opcheck(ops.bias_dropout_add_forward.default, (x, None, r, 0.5, 7, 12))
    torch.library.opcheck(ops.dropout_backward.default, (grad, 0.5, 7, 0))


def test_bad_input_is_refused():
    x, b, r, _ = _inputs(torch.float64)
    with pytest.raises(ValueError, match=r"bias must have shape \[24\]"):
        bias_gelu(x, b[:-1])
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        bias_gelu(x, b, "sigmoid")
    with pytest.raises(ValueError, match="bias dtype Float differs from the input dtype Double"):
        bias_gelu(x, b.float())
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\], got 1.5"):
        ops.bias_dropout_add(x, b, r, 1.5, True)
    with pytest.raises(ValueError, match="residual has shape"):
        ops.bias_dropout_add(x, b, r[:-1], 0.1, True)
    with pytest.raises(ValueError, match="input must be a floating tensor"):
        ops.bias_gelu(torch.ones(3, 4, dtype=torch.long), torch.ones(4, dtype=torch.long), False)


def _weight_grad_checks(group_name: str) -> None:
    """gradient_accumulation_fusion: main_grad (fp32) += grad_output^T @ input from 16-bit operands,
    equal to the GEMM of the same operands in fp32."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(4, 3, 16, generator=g).to(dtype).requires_grad_()
        w = torch.randn(8, 16, generator=g).to(dtype).requires_grad_()
        start = torch.randn(8, 16, generator=g)
        main_grad = start.clone()
        grad = torch.randn(4, 3, 8, generator=g).to(dtype)
        w.main_grad = main_grad
        out = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False
        )
        out.backward(grad)
        expected = start + grad.reshape(-1, 8).float().t() @ x.detach().reshape(-1, 16).float()
        assert w.grad is None
        assert main_grad.dtype == torch.float32
        assert_close(main_grad, expected, rtol=1e-6, atol=1e-5)


# --- the transformer layer with the fusion flags on equals it with them off ------------------

VOCAB, SEQ, BATCH, SEED = 64, 8, 3, 7
FLAGS = ("bias_activation_fusion", "bias_dropout_fusion")


def _gpt(tp: int, fused: bool, hidden_dropout: float = 0.0, recompute: bool = False):
    from megatron_ext.models import GPTModel
    from megatron_ext.transformer import TransformerConfig

    config = TransformerConfig(
        tensor_model_parallel_size=tp,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        use_cpu_initialization=True,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )
    for flag in FLAGS:
        setattr(config, flag, fused)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=SEED)


def _run(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    model.train()
    # Every run (and every rank) starts the default generator, which hidden dropout draws from, alike.
    torch.manual_seed(11)
    loss = model(tokens, positions, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _shard_of(name: str, full: torch.Tensor, local: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if full.shape == local.shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
    return full.chunk(tp, dim)[rank]


def _layer_flags_worker() -> list[tuple]:
    """Fusion flags on against off, serial against TP 2 (recorded comparisons, made in the test)."""
    compared = Comparisons()
    exact = dict(rtol=1e-10, atol=1e-12)
    ps.initialize_model_parallel(1)
    _weight_grad_checks(ps.get_tensor_model_parallel_group().group_name)
    ref_loss, ref_grads = _run(_gpt(1, fused=False))
    loss, grads = _run(_gpt(1, fused=True))
    compared.close(loss, ref_loss, **exact)
    for name, grad in grads.items():
        compared.close(grad, ref_grads[name], **exact, label=name)
    # With dropout on, the fused masks come from the default generator, which every layout seeds
    # alike: serial with and without recomputation, then tensor parallel, agree.
    drop_loss, drop_grads = _run(_gpt(1, fused=True, hidden_dropout=0.2))
    assert (drop_loss - ref_loss).abs().max() > 1e-3  # dropout did change the loss
    re_loss, re_grads = _run(_gpt(1, fused=True, hidden_dropout=0.2, recompute=True))
    compared.close(re_loss, drop_loss, **exact)
    for name, grad in re_grads.items():
        compared.close(grad, drop_grads[name], **exact, label=name)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(2)
    rank = ps.get_tensor_model_parallel_rank()
    for dropout, (want_loss, want_grads) in ((0.0, (ref_loss, ref_grads)), (0.2, (drop_loss, drop_grads))):
        loss, grads = _run(_gpt(2, fused=True, hidden_dropout=dropout))
        compared.close(loss, want_loss, **exact)
        for name, grad in grads.items():
            compared.close(grad, _shard_of(name, want_grads[name], grad, 2, rank), **exact, label=name)
    ps.destroy_model_parallel()
    return compared.made


@pytest.mark.slow
def test_transformer_layer_fusion_flags_on_equal_off_and_parallel_equals_serial():
    results = run_distributed(2, _layer_flags_worker)
    for made in results:
        assert_comparisons(made)
    assert len({len(made) for made in results}) == 1


def test_kernels_registered_for_every_backend_built():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    for op in ("bias_gelu_forward", "bias_gelu_backward", "bias_dropout_add_forward", "dropout_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta"), op
        assert has_kernel(op, "CUDA") == cuda, op
    for op in ("bias_gelu", "bias_dropout_add"):
        for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
            assert has_kernel(op, key), (op, key)
