"""GPU benchmark of the cross-entropy and the fused epilogue kernels against megatron-core's torch-op
equivalents.

For each kernel: the median time, the bytes it must move (each input read once, each output written
once) divided by that time, and that figure as a share of the device's memory bandwidth (measured
here with a device-to-device copy; the nominal peak is shown where the device is known). The
megatron-core columns are its code paths written inline as the same torch ops (run eagerly),
because megatron-core may be absent on the GPU machine; megatron-core itself may wrap them in
torch.compile / TorchScript (``jit_fuser``), which is not done here.

    python benchmarks/gpu.py [--tokens 8192] [--hidden 4096] [--vocab 32000] [--json runs/gpu_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_ext  # noqa: E402

ops = torch.ops.megatron_ext

# Nominal HBM bandwidth in GB/s, for the table only (the share is taken against the measured copy).
NOMINAL_GBPS = {
    "H100 80GB HBM3": 3350,
    "H100 PCIe": 2000,
    "H200": 4800,
    "A100-SXM4-80GB": 2039,
    "A100-SXM4-40GB": 1555,
    "A100 80GB PCIe": 1935,
}


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


# megatron-core's torch-op paths, written inline.


def mcore_bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def mcore_bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


def mcore_bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float):
    return residual + F.dropout(x + bias, p=p, training=True)


def mcore_cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor):
    # VocabParallelCrossEntropy at one rank: max, shift, gather the target, exp, sum, log.
    logits = logits.float()
    logits_max = logits.max(dim=-1)[0]
    logits = logits - logits_max.unsqueeze(-1)
    predicted = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    exp_logits = logits.exp()
    sum_exp = exp_logits.sum(dim=-1)
    loss = torch.log(sum_exp) - predicted
    softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
    return loss, softmax


def mcore_cross_entropy_backward(softmax: torch.Tensor, target: torch.Tensor, grad: torch.Tensor):
    grad_input = softmax.clone()
    rows = torch.arange(grad_input.size(0), device=grad_input.device)
    grad_input[rows, target] -= 1.0
    return grad_input.mul_(grad.unsqueeze(-1))


def run(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth_gbps()
    n, ffn = args.tokens, 4 * args.hidden
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    rows = []

    def add(name: str, bytes_moved: float, ours: Callable, mcore: Callable | None):
        ours_ms = time_ms(ours)
        mcore_ms = time_ms(mcore) if mcore is not None else None
        gbps = bytes_moved / ours_ms / 1e6
        rows.append(
            {
                "kernel": name,
                "bytes": bytes_moved,
                "ours_ms": ours_ms,
                "ours_gbps": gbps,
                "ours_share_of_copy_bw": gbps / copy_gbps,
                "mcore_torch_ops_ms": mcore_ms,
                "speedup": (mcore_ms / ours_ms) if mcore_ms else None,
            }
        )

    y, bias, g = randn(n, ffn), randn(ffn), randn(n, ffn)
    elems = n * ffn
    add(
        "bias_gelu fwd (tanh)",
        2 * elems * esize,
        lambda: ops.bias_gelu_forward(y, bias, True),
        lambda: mcore_bias_gelu(bias, y),
    )
    add(
        "bias_gelu bwd (tanh)",
        3 * elems * esize,
        lambda: ops.bias_gelu_backward(g, y, bias, True),
        lambda: mcore_bias_gelu_back(g, bias, y),
    )
    add(
        "bias_gelu fwd (erf)",
        2 * elems * esize,
        lambda: ops.bias_gelu_forward(y, bias, False),
        lambda: F.gelu(y + bias),
    )
    del y, g

    x, r, hb, gh = randn(n, args.hidden), randn(n, args.hidden), randn(args.hidden), randn(n, args.hidden)
    elems = n * args.hidden
    add(
        "bias_dropout_add fwd",
        3 * elems * esize,
        lambda: ops.bias_dropout_add(x, hb, r, 0.1, True),
        lambda: mcore_bias_dropout_add(x, hb, r, 0.1),
    )
    add(
        "dropout bwd",
        2 * elems * esize,
        lambda: ops.dropout_backward(gh, 0.1, 1, 0),
        lambda: gh * (torch.rand_like(gh) > 0.1) * (1 / 0.9),
    )
    del x, r, gh

    logits = randn(n, args.vocab)
    target = torch.randint(0, args.vocab, (n,), device="cuda", generator=gen)
    grad_loss = torch.rand(n, device="cuda", generator=gen)
    stats = ops.vocab_parallel_cross_entropy_row_stats(logits, target, 0, None)
    row_max, lse = stats[:, 0].contiguous(), stats[:, 1].log().contiguous()
    elems = n * args.vocab
    _, softmax = mcore_cross_entropy_forward(logits, target)
    add(
        "cross_entropy row stats (fwd)",
        elems * esize,
        lambda: ops.vocab_parallel_cross_entropy_row_stats(logits, target, 0, None),
        lambda: mcore_cross_entropy_forward(logits, target),
    )
    add(
        "cross_entropy bwd",
        2 * elems * esize,
        lambda: ops.vocab_parallel_cross_entropy_backward(
            grad_loss, logits, target, row_max, lse, 0.0, None, 0, args.vocab
        ),
        lambda: mcore_cross_entropy_backward(softmax, target, grad_loss),
    )
    del logits, softmax

    # The weight-gradient GEMM of gradient_accumulation_fusion as accumulate_weight_grad_ runs it
    # (16-bit operands, fp32 main_grad) against the fp32 copies it replaced; TFLOP/s, not bytes.
    go, inp = randn(n, args.hidden), randn(n, ffn)
    main_grad = torch.zeros(args.hidden, ffn, device="cuda", dtype=torch.float32)
    flops = 2 * n * args.hidden * ffn
    gemm = []
    if dtype in (torch.bfloat16, torch.float16):
        fused_ms = time_ms(
            lambda: torch.addmm(main_grad, go.t(), inp, out_dtype=torch.float32, out=main_grad)
        )
        copies_ms = time_ms(lambda: main_grad.addmm_(go.t().float(), inp.float()))
        gemm.append(
            {
                "kernel": "wgrad into fp32 main_grad",
                "ours_ms": fused_ms,
                "ours_tflops": flops / fused_ms / 1e9,
                "fp32_copies_ms": copies_ms,
                "fp32_copies_tflops": flops / copies_ms / 1e9,
            }
        )

    return {
        "device": props.name,
        "torch": torch.__version__,
        "megatron_ext_build": megatron_ext.build_info(),
        "dtype": args.dtype,
        "tokens": n,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "copy_bandwidth_gbps": copy_gbps,
        "nominal_bandwidth_gbps": NOMINAL_GBPS.get(props.name),
        "kernels": rows,
        "gemm": gemm,
        "note": "megatron-core columns: its torch-op code paths written inline, run eagerly (megatron-core "
        "is not needed on the GPU machine)",
    }


def print_table(result: dict) -> None:
    nominal = result["nominal_bandwidth_gbps"]
    print(
        f"{result['device']}, torch {result['torch']}, {result['dtype']}, tokens {result['tokens']}, "
        f"hidden {result['hidden']}, vocab {result['vocab']}"
    )
    print(
        f"device-to-device copy: {result['copy_bandwidth_gbps']:.0f} GB/s"
        + (f" (nominal {nominal} GB/s)" if nominal else "")
    )
    header = (
        f"{'kernel':32s} {'ours ms':>9s} {'GB/s':>7s} {'% copy':>7s} {'mcore ops ms':>13s} {'speed-up':>9s}"
    )
    print(header)
    print("-" * len(header))
    for r in result["kernels"]:
        mc = f"{r['mcore_torch_ops_ms']:13.3f}" if r["mcore_torch_ops_ms"] is not None else f"{'-':>13s}"
        sp = f"{r['speedup']:8.2f}x" if r["speedup"] else f"{'-':>9s}"
        print(
            f"{r['kernel']:32s} {r['ours_ms']:9.3f} {r['ours_gbps']:7.0f} "
            f"{100 * r['ours_share_of_copy_bw']:6.1f}% {mc} {sp}"
        )
    for gm in result["gemm"]:
        print(
            f"{gm['kernel']}: {gm['ours_ms']:.3f} ms ({gm['ours_tflops']:.0f} TFLOP/s); "
            f"with fp32 operand copies {gm['fp32_copies_ms']:.3f} ms ({gm['fp32_copies_tflops']:.0f} TFLOP/s)"
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="sequence x micro-batch rows")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary columns on this rank")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", default="runs/gpu_bench.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU")
    if not megatron_ext.build_info()["cuda_compiled"]:
        raise SystemExit("megatron_ext was built without CUDA: rebuild with FORCE_CUDA=1")
    result = run(args)
    print_table(result)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
