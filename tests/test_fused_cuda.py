"""The GPU path (marked ``cuda``; skipped without a GPU; ``./dev.sh gpu`` runs it):

* every CUDA kernel against its CPU twin in float32, bfloat16 and float16 (the rotary kernels bit
  for bit, float64 too);
* the regions, the linear (with gradient-accumulation fusion), the cross-entropy and the per-token
  gradient scaling of ``finalize_model_grads`` on a one-rank NCCL group;
* the GPT training example (``examples/train_gpt.py``) at tp 1 on one GPU equal to its CPU run in
  float32.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

import megatron_ext
from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from tests.conftest import ROOT, has_kernel

HAS_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]

ops = torch.ops.megatron_ext
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# CPU and GPU libm differ by an ulp or two; a 16-bit result may then round to the neighbouring value.
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-13),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def test_extension_has_its_cuda_kernels():
    assert megatron_ext.build_info()["cuda_compiled"], "built without CUDA on a machine with a GPU"
    for op in ("bias_gelu_forward", "bias_dropout_add_forward", "vocab_parallel_cross_entropy_row_stats",
               "rms_norm_forward", "rms_norm_backward", "rotary_pos_emb_forward", "rotary_pos_emb_backward",
               "swiglu_forward", "swiglu_backward", "moe_gather_rows", "moe_scatter_add_rows",
               "moe_gathered_row_dot", "causal_conv1d_forward", "causal_conv1d_backward",
               "gated_delta_rule_forward", "gated_delta_rule_backward",
               "mamba_chunk_scan_forward", "mamba_chunk_scan_backward"):
        assert has_kernel(op, "CUDA"), op


# Width 200: 16-byte packs in every dtype; 201: the element-wise kernels.
@pytest.mark.parametrize("width", [200, 201])
@pytest.mark.parametrize("tanh", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_kernels_equal_cpu_twin(dtype, tanh, width):
    x = _randn(33, 2, width, dtype=dtype, seed=1, scale=3.0)
    b = _randn(width, dtype=dtype, seed=2)
    g = _randn(33, 2, width, dtype=dtype, seed=3)
    cpu = ops.bias_gelu_forward(x, b, tanh)
    gpu = ops.bias_gelu_forward(x.cuda(), b.cuda(), tanh)
    assert_close(gpu.cpu(), cpu, **TOL[dtype])
    cpu = ops.bias_gelu_backward(g, x, b, tanh)
    gpu = ops.bias_gelu_backward(g.cuda(), x.cuda(), b.cuda(), tanh)
    assert_close(gpu.cpu(), cpu, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_kernels_equal_cpu_twin(dtype):
    shape = (17, 3, 129)  # numel not a multiple of the Philox group
    x, r, g = (_randn(*shape, dtype=dtype, seed=s) for s in (4, 5, 6))
    b = _randn(129, dtype=dtype, seed=7)
    seed, offset = 0x1234_5678_9ABC, 40
    cpu = ops.bias_dropout_add_forward(x, b, r, 0.3, seed, offset)
    gpu = ops.bias_dropout_add_forward(x.cuda(), b.cuda(), r.cuda(), 0.3, seed, offset)
    assert_close(gpu.cpu(), cpu, **TOL[dtype])
    ones, zeros = torch.ones(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    mask_cpu = ops.bias_dropout_add_forward(ones, None, zeros, 0.3, seed, offset) != 0
    mask_gpu = ops.bias_dropout_add_forward(ones.cuda(), None, zeros.cuda(), 0.3, seed, offset) != 0
    assert torch.equal(mask_gpu.cpu(), mask_cpu)  # the same elements dropped, bit for bit
    assert_close(
        ops.dropout_backward(g.cuda(), 0.3, seed, offset).cpu(),
        ops.dropout_backward(g, 0.3, seed, offset),
        **TOL[dtype],
    )


def test_fused_dropout_replays_the_cuda_generator():
    x = _randn(64, 4, 256, dtype=torch.float32, seed=8).cuda().requires_grad_()
    b = _randn(256, dtype=torch.float32, seed=9).cuda().requires_grad_()
    r = _randn(64, 4, 256, dtype=torch.float32, seed=10).cuda()
    state = torch.cuda.get_rng_state()
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    start = gen.get_offset()
    first = ops.bias_dropout_add(x, b, r, 0.2, True)
    # One Philox counter per four elements, each counting four 32-bit numbers of the generator's
    # offset: the next draw (ours or torch's) starts past every counter this one used.
    assert gen.get_offset() - start == 4 * (x.numel() // 4)
    second = ops.bias_dropout_add(x, b, r, 0.2, True)
    assert not torch.equal(first, second)
    torch.cuda.set_rng_state(state)
    replay = ops.bias_dropout_add(x, b, r, 0.2, True)
    assert torch.equal(replay, first)
    replay.backward(torch.ones_like(replay))
    torch.cuda.set_rng_state(state)
    ones = torch.ones_like(r)
    mask_scale = ops.bias_dropout_add(ones, None, torch.zeros_like(r), 0.2, True)  # mask / 0.8
    assert torch.equal(x.grad, mask_scale)
    assert_close(first, r + (x + b).detach() * mask_scale)
    kept = (x.grad != 0).float().mean().item()
    assert abs(kept - 0.8) < 0.01, kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_kernels_equal_cpu_twin(dtype):
    logits = _randn(37, 1000, dtype=dtype, seed=11, scale=4.0)
    target = torch.randint(0, 2000, (37,), generator=torch.Generator().manual_seed(12))
    target[3] = -100
    stats_cpu = ops.vocab_parallel_cross_entropy_row_stats(logits, target, 1000, -100)
    stats_gpu = ops.vocab_parallel_cross_entropy_row_stats(logits.cuda(), target.cuda(), 1000, -100)
    assert_close(stats_gpu.cpu(), stats_cpu, rtol=1e-5, atol=1e-4)
    row_max = stats_cpu[:, 0].contiguous()
    lse = stats_cpu[:, 1].log().contiguous()
    grad_loss = torch.rand(37, generator=torch.Generator().manual_seed(13), dtype=stats_cpu.dtype)
    # This rank holds vocabulary rows [1000, 2000): the backward takes each token's local column,
    # -1 for a target another rank holds, -2 for an ignored one.
    column = target - 1000
    local = torch.where((column >= 0) & (column < 1000), column, -1)
    local[target == -100] = -2
    assert (local >= 0).any() and (local == -1).any()
    cpu = ops.vocab_parallel_cross_entropy_backward(grad_loss, logits, local, row_max, lse, 0.1, 2000)
    gpu = ops.vocab_parallel_cross_entropy_backward(
        grad_loss.cuda(), logits.cuda(), local.cuda(), row_max.cuda(), lse.cuda(), 0.1, 2000
    )
    assert_close(gpu.cpu(), cpu, **TOL[dtype])


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within TOL, the absolute part scaled by the largest value (sums whose terms partly cancel)."""
    tol = TOL[dtype]
    assert_close(got.cpu().float(), want.float(), rtol=tol["rtol"],
                 atol=tol["atol"] * max(1.0, want.float().abs().max().item()))


@pytest.mark.parametrize("width", [1024, 1003])  # rows of whole 16-byte packs (the packed kernels), or not
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_rms_norm_kernels_equal_cpu_twin(dtype, width):
    # 1332 rows: more than the weight-gradient kernel's chunks of rows on any GPU (4 per
    # multiprocessor), so a chunk sums several rows.
    x = _randn(333, 4, width, dtype=dtype, seed=30, scale=2.0)
    w = _randn(width, dtype=dtype, seed=31)
    g = _randn(333, 4, width, dtype=dtype, seed=32)
    out, rstd = ops.rms_norm_forward(x, w, 1e-5)
    gpu_out, gpu_rstd = ops.rms_norm_forward(x.cuda(), w.cuda(), 1e-5)
    assert gpu_rstd.dtype == rstd.dtype == (torch.float32 if dtype != torch.float64 else torch.float64)
    assert_close(gpu_rstd.cpu(), rstd, rtol=1e-5, atol=0)
    assert_close(gpu_out.cpu(), out, **TOL[dtype])
    for got, want in zip(ops.rms_norm_backward(g.cuda(), x.cuda(), w.cuda(), rstd.cuda()),
                         ops.rms_norm_backward(g, x, w, rstd)):
        assert got.dtype == want.dtype
        _close_to_scale(got, want, dtype)


@pytest.mark.parametrize("first_lane, rot", [(64, 48), (65, 48), (64, 40)])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_rotary_kernels_equal_cpu_twin_bit_for_bit(dtype, interleaved, first_lane, rot):
    # Heads read in place from a wider tensor (a fused QKV view, sliced on each device); rot of the
    # 64 lanes rotate. No transcendental runs in the kernels and each product is rounded on both
    # devices. Heads at lane 64 with 48 rotated lanes take the kernel over 16-byte packs; heads at
    # lane 65 are not 16-byte aligned, and 40 rotated lanes do not split into whole 16-bit packs
    # of halves: the kernel over elements.
    base = _randn(9, 2, 3, 3 * 64, dtype=dtype, seed=33)
    angles = _randn(9, rot, dtype=torch.float32, seed=34, scale=3.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for fn in (ops.rotary_pos_emb_forward, ops.rotary_pos_emb_backward):
        got = fn(base.cuda()[..., first_lane:first_lane + 64], cos.cuda(), sin.cuda(), interleaved)
        want = fn(base[..., first_lane:first_lane + 64], cos, sin, interleaved)
        assert torch.equal(got.cpu(), want), fn


@pytest.mark.parametrize("width", [128, 129])  # whole 16-byte packs (the kernel over packs), or not
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_swiglu_kernels_equal_cpu_twin(dtype, with_bias, width):
    y = _randn(17, 3, 2 * width, dtype=dtype, seed=35, scale=3.0)
    b = _randn(2 * width, dtype=dtype, seed=36) if with_bias else None
    g = _randn(17, 3, width, dtype=dtype, seed=37)
    cuda_b = b.cuda() if with_bias else None
    assert_close(ops.swiglu_forward(y.cuda(), cuda_b).cpu(), ops.swiglu_forward(y, b), **TOL[dtype])
    assert_close(ops.swiglu_backward(g.cuda(), y.cuda(), cuda_b).cpu(), ops.swiglu_backward(g, y, b),
                 **TOL[dtype])


@pytest.mark.parametrize("width", [200, 201])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_clamped_quick_geglu_kernels_equal_cpu_twin(dtype, with_bias, width):
    """gpt-oss's unit (alpha 1.702, offset 1, clamp 7; y spread past the clamp) and a clamped SiLU
    with an offset: the GPU kernels' general path against the CPU twin."""
    y = _randn(17, 3, 2 * width, dtype=dtype, seed=42, scale=6.0)
    b = _randn(2 * width, dtype=dtype, seed=43) if with_bias else None
    g = _randn(17, 3, width, dtype=dtype, seed=44)
    cuda_b = b.cuda() if with_bias else None
    for unit in ((1.702, 1.0, 7.0), (1.0, -0.5, 2.0), (1.702, 0.0, None)):
        assert_close(ops.swiglu_forward(y.cuda(), cuda_b, *unit).cpu(), ops.swiglu_forward(y, b, *unit),
                     **TOL[dtype])
        assert_close(ops.swiglu_backward(g.cuda(), y.cuda(), cuda_b, *unit).cpu(),
                     ops.swiglu_backward(g, y, b, *unit), **TOL[dtype])


def test_llama_fusions_autograd_on_gpu_equal_cpu():
    from megatron_ext.fusions import bias_swiglu, fused_apply_rotary_pos_emb, fused_rms_norm

    x = _randn(8, 2, 64, dtype=torch.float32, seed=38)
    w = _randn(64, dtype=torch.float32, seed=39)
    freqs = _randn(8, 1, 1, 16, dtype=torch.float32, seed=40)
    b = _randn(32, dtype=torch.float32, seed=41)

    def block(x, w, b):
        h = fused_rms_norm(x, w, 1e-5)
        q = fused_apply_rotary_pos_emb(h.view(8, 2, 4, 16), freqs.to(x.device), True)
        return bias_swiglu(q.reshape(8, 2, 64)[..., :32], b)

    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_() for t in (x, w, b)]
        out = block(*leaves)
        results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    for got, want in zip(results[1], results[0]):
        _close_to_scale(got, want.detach(), torch.float32)


def test_vocab_mask_kernel_equals_cpu_twin():
    ids = torch.randint(0, 500, (7, 33), generator=torch.Generator().manual_seed(14))
    for got, want in zip(ops.vocab_range_mask(ids.cuda(), 100, 250), ops.vocab_range_mask(ids, 100, 250)):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_moe_permutation_kernels_equal_cpu_twin(dtype):
    """permute / unpermute (with probs, dropless and with a capacity) forward and backward on the
    GPU against the CPU kernels; the grouped GEMM's loop and torch._grouped_mm against the CPU
    loop."""
    from megatron_ext.transformer.moe import moe_utils
    from megatron_ext.transformer.moe.grouped_gemm_util import ops as gg

    g = torch.Generator().manual_seed(15)
    scores = torch.randn(37, 8, generator=g)
    routing_map = torch.zeros(37, 8, dtype=torch.bool).scatter(1, scores.topk(2, dim=1).indices, True)
    probs = (torch.softmax(scores, -1) * routing_map).to(dtype)
    tokens = _randn(37, 200, dtype=dtype, seed=16)
    up = _randn(37, 200, dtype=dtype, seed=17)
    tol = TOL.get(dtype, dict(rtol=1e-12, atol=1e-12))
    for num_out, drop in ((None, False), (40, True)):
        results = []
        for device in ("cpu", "cuda"):
            x, p = tokens.to(device).requires_grad_(), probs.to(device).requires_grad_()
            rmap = routing_map.to(device)
            rows, permuted_probs, idx = moe_utils.permute(x, rmap, p, num_out, drop_and_pad=drop)
            out = moe_utils.unpermute(rows * 2, idx, x.shape, p, rmap, drop_and_pad=drop)
            grads = torch.autograd.grad(out, (x, p), up.to(device))
            results.append([rows, permuted_probs, idx, out, *grads])
        for got, want in zip(results[1], results[0]):
            assert_close(got.cpu(), want.detach(), **tol)
    sizes = torch.tensor([5, 0, 19, 8])
    a = _randn(32, 64, dtype=dtype, seed=18)
    b = _randn(4, 64, 48, dtype=dtype, seed=19, scale=0.1)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [a.to(device).requires_grad_(), b.to(device).requires_grad_()]
        out = gg.gmm(*leaves, sizes)
        results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    for got, want in zip(results[1], results[0]):
        if dtype == torch.float64:
            assert_close(got.cpu(), want.detach())
        else:
            _close_to_scale(got, want.detach(), dtype)


# --- a one-rank NCCL group -----------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl_group():
    if not HAS_GPU:
        pytest.skip("needs a CUDA GPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    ps.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield ps.get_tensor_model_parallel_group().group_name
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_regions_on_one_rank_nccl_group(nccl_group):
    x = _randn(4, 3, 8, dtype=torch.float32, seed=15).cuda().requires_grad_()
    for fn in (
        tensor_parallel.copy_to_tensor_model_parallel_region,
        tensor_parallel.reduce_from_tensor_model_parallel_region,
        tensor_parallel.scatter_to_tensor_model_parallel_region,
        tensor_parallel.gather_from_tensor_model_parallel_region,
        tensor_parallel.scatter_to_sequence_parallel_region,
        tensor_parallel.gather_from_sequence_parallel_region,
        tensor_parallel.reduce_scatter_to_sequence_parallel_region,
    ):
        y = fn(x)
        assert y.is_cuda and torch.equal(y, x), fn.__name__
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(grad, torch.ones_like(x)), fn.__name__


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_with_gradient_accumulation_fusion_on_nccl(nccl_group, dtype):
    x = _randn(16, 2, 64, dtype=dtype, seed=16).cuda().requires_grad_()
    w = _randn(32, 64, dtype=dtype, seed=17).cuda().requires_grad_()
    b = _randn(32, dtype=dtype, seed=18).cuda().requires_grad_()
    start = _randn(32, 64, dtype=torch.float32, seed=19).cuda()
    main_grad = start.clone()
    g = _randn(16, 2, 32, dtype=dtype, seed=20).cuda()
    w.main_grad = main_grad
    out = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        x, w, b, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False
    )
    assert_close(out, F.linear(x, w, b), **TOL[dtype])
    out.backward(g)
    expected = start + g.reshape(-1, 32).float().t() @ x.detach().reshape(-1, 64).float()
    assert main_grad.dtype == torch.float32 and w.grad is None
    assert_close(main_grad, expected, rtol=1e-4, atol=1e-3)
    assert_close(x.grad, g @ w.detach(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_on_nccl(nccl_group, dtype):
    logits = _randn(8, 4, 300, dtype=dtype, seed=21, scale=3.0).cuda().requires_grad_()
    target = torch.randint(0, 300, (8, 4), generator=torch.Generator().manual_seed(22)).cuda()
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 300), target.reshape(-1), reduction="none").reshape(8, 4)
    assert_close(loss.float(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    assert_close(logits.grad.float(), ref_logits.grad, **TOL[dtype])


def test_finalize_model_grads_per_token_on_nccl(nccl_group):
    # The schedules count the tokens in a CPU tensor; NCCL reduces only CUDA tensors.
    from megatron_ext.distributed import finalize_model_grads

    model = torch.nn.Linear(3, 2).cuda()
    model(_randn(5, 3, dtype=torch.float32, seed=23).cuda()).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    finalize_model_grads([model], num_tokens=torch.tensor(4))
    for p, g in zip(model.parameters(), before):
        assert_close(p.grad, g / 4)  # one data-parallel rank: the sum over tokens / 4 tokens


def _run_train_gpt(device: str, tmp_path) -> list[float]:
    """``examples/train_gpt.py`` at tp 1 x pp 1, one process under torchrun, fused epilogues on."""
    log = tmp_path / f"{device}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "examples" / "train_gpt.py"), "--device", device, "--tp", "1", "--pp", "1",
           "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--micro-batch-size", "4",
           "--global-batch-size", "8", "--steps", "6", "--no-progress", "--plot", "", "--log-json", str(log)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [record["loss"] for record in map(json.loads, log.read_text().splitlines()) if "loss" in record]


def test_train_gpt_example_on_gpu_equals_cpu(tmp_path):
    cuda_losses = _run_train_gpt("cuda", tmp_path)
    cpu_losses = _run_train_gpt("cpu", tmp_path)
    assert len(cuda_losses) == 6 and cuda_losses[-1] < cuda_losses[0]
    # float32 on both; the GPU's GEMM and reduction orders differ from the CPU's.
    assert_close(torch.tensor(cuda_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-4)
