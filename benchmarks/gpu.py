"""GPU benchmark of the fused kernels (the epilogues, RMSNorm, rotary embedding, SwiGLU) and the
cross-entropy against megatron-core 0.16.1.

Each row is one operation; its variants run in the same process, interleaved rep by rep in a
rotating order (the first rep a warm-up, which also compiles megatron-core's ``torch.compile``d
fusions), each rep timed with CUDA events around one call after a device synchronize. Reported per
variant: min / median / max milliseconds, the bytes the operation must move (each input read once,
each output written once) divided by the median time, that figure as a share of the device's
memory bandwidth (measured here with a device-to-device copy), and the peak extra device memory of
a call (``max_memory_allocated`` minus what was allocated before it), and the largest difference of
its result (the cross-entropy: the logits' gradient) from the first variant's (not for dropout,
whose masks differ).

megatron-core is the real package (``megatron.core.fusions`` and
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``, on a one-rank process group, with
its own parallel_state), compiled as megatron-core compiles it (``jit_fuser`` is ``torch.compile``
on torch >= 2.2). The cross-entropy also runs PyTorch DTensor's ``loss_parallel`` on a one-rank mesh. Rows
megatron-core has no code for compare with the torch ops it would run.
Without megatron-core importable the script stops, unless ``--without-megatron-core``.

``--device cpu`` runs the same code on the CPU twins with small sizes, to check the script itself
(wall-clock timing, no bandwidth share, no memory figure); its numbers are not GPU figures.

    python benchmarks/gpu.py [--tokens 8192] [--hidden 4096] [--vocab 32000] [--reps 30]
                             [--json runs/gpu_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_ext  # noqa: E402
from common import MEGATRON_CORE_VERSION, import_megatron_core, megatron_core_version  # noqa: E402
from llama_kernels import _freqs, _unfused_swiglu  # noqa: E402
from megatron_ext import fusions  # noqa: E402
from megatron_ext import parallel_state as ps  # noqa: E402
from megatron_ext import tensor_parallel  # noqa: E402

ops = torch.ops.megatron_ext

# A variant: (prepare, run). prepare() runs outside the timed region and its result is run's
# argument (fresh inputs for an operation that overwrites them).
Variant = tuple[Callable[[], Any], Callable[[Any], Any]]


def _nothing() -> None:
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(variants: dict[str, Variant], reps: int, device: torch.device) -> dict[str, dict]:
    """Every variant once per rep, in a rotating order; the first rep is not counted."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    cuda = device.type == "cuda"
    for rep in range(reps + 1):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            prepare, run = variants[name]
            arg = prepare()
            _sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(arg)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
                peak = torch.cuda.max_memory_allocated(device) - before
            else:
                t0 = time.perf_counter()
                run(arg)
                ms, peak = (time.perf_counter() - t0) * 1e3, None
            del arg
            if rep > 0:
                times[name].append(ms)
                peaks[name].append(peak)
    return {
        n: {
            "min_ms": min(times[n]),
            "median_ms": statistics.median(times[n]),
            "max_ms": max(times[n]),
            "peak_extra_mib": None if peaks[n][0] is None else max(peaks[n]) / 2**20,
        }
        for n in names
    }


def copy_bandwidth_gbps(device: torch.device) -> float | None:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (None on CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    stats = time_variants({"copy": (_nothing, lambda _: dst.copy_(src))}, 10, device)["copy"]
    return 2 * src.numel() / stats["median_ms"] / 1e6


def _megatron_core(device: torch.device):
    """megatron-core's functions used here, its parallel_state initialized at tp 1, or None."""
    if import_megatron_core() is None:
        return None
    from megatron.core import parallel_state as mps
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    from megatron.core.fusions.fused_bias_gelu import bias_gelu, bias_gelu_back
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    mps.initialize_model_parallel(1, 1)
    return {
        "bias_gelu": bias_gelu,
        "bias_gelu_back": bias_gelu_back,
        "bias_dropout_add_fused_train": bias_dropout_add_fused_train,
        "vocab_parallel_cross_entropy": vocab_parallel_cross_entropy,
        "bias_swiglu_impl": bias_swiglu_impl,
        "_apply_rotary_pos_emb_bshd": _apply_rotary_pos_emb_bshd,
    }


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # set_device needs an index (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    es = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    ps.initialize_model_parallel(1, 1)
    mcore = None if args.without_megatron_core else _megatron_core(device)
    copy_gbps = copy_bandwidth_gbps(device)
    n, h, ffn, vocab = args.tokens, args.hidden, 4 * args.hidden, args.vocab
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad: bool = False):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_(grad)

    rows = []

    def row(
        name: str, bytes_moved: float, variants: dict[str, Variant], compare: str | None = "output"
    ) -> None:
        """Times the variants; with ``compare`` ("output": what run returns, "grad": the prepared
        input's gradient) also records each one's largest difference from the first variant's."""
        variants = {k: v for k, v in variants.items() if v is not None}
        stats = time_variants(variants, args.reps, device)
        reference = None
        for k, (prepare, run) in variants.items():
            s = stats[k]
            s["gbps"] = bytes_moved / s["median_ms"] / 1e6
            s["share_of_copy_bw"] = s["gbps"] / copy_gbps if copy_gbps else None
            s["max_abs_diff"] = None
            if compare:
                arg = prepare()
                value = run(arg)
                value = (value if compare == "output" else arg.grad).detach().double()
                reference = value if reference is None else reference
                s["max_abs_diff"] = (value - reference).abs().max().item()
        rows.append({"op": name, "bytes": bytes_moved, "variants": stats})

    def plain(fn: Callable[[], Any]) -> Variant:
        return _nothing, lambda _: fn()

    def mc(name: str, make: Callable[[Callable], Variant]) -> Variant | None:
        return make(mcore[name]) if mcore else None

    # bias + GeLU on the first MLP linear's output [tokens, 4h].
    y, b, g = randn(n, ffn), randn(ffn), randn(n, ffn)
    with torch.no_grad():
        row("bias_gelu fwd (tanh)", (2 * n * ffn + ffn) * es, {
            "megatron_ext": plain(lambda: ops.bias_gelu_forward(y, b, True)),
            "megatron-core": mc("bias_gelu", lambda f: plain(lambda: f(b, y))),
        })
        row("bias_gelu bwd (tanh)", (3 * n * ffn + ffn) * es, {
            "megatron_ext": plain(lambda: ops.bias_gelu_backward(g, y, b, True)),
            "megatron-core": mc("bias_gelu_back", lambda f: plain(lambda: f(g, b, y))),
        })
        # megatron-core fuses only the tanh form; the erf form is its unfused torch path.
        row("bias_gelu fwd (erf)", (2 * n * ffn + ffn) * es, {
            "megatron_ext": plain(lambda: ops.bias_gelu_forward(y, b, False)),
            "torch F.gelu(y + b)": plain(lambda: F.gelu(y + b)),
        })
    y = g = None  # free them (the closures above hold the names)

    # bias + dropout + residual on the attention / MLP output [tokens, h].
    x, hb, r, gh = randn(n, h), randn(h), randn(n, h), randn(n, h)
    with torch.no_grad():
        row("bias_dropout_add fwd (p 0.1)", (3 * n * h + h) * es, {
            "megatron_ext": plain(lambda: fusions.bias_dropout_add_fused_train((x, hb), r, 0.1)),
            "megatron-core": mc("bias_dropout_add_fused_train", lambda f: plain(lambda: f((x, hb), r, 0.1))),
        }, compare=None)  # different random masks

    def dropout_fwd_bwd(f: Callable) -> Variant:
        def prepare():
            return x.detach().requires_grad_(), hb.detach().requires_grad_(), r.detach().requires_grad_()

        def go(leaves):
            f((leaves[0], leaves[1]), leaves[2], 0.1).backward(gh)

        return prepare, go

    # Forward 3 reads/writes of [n, h], backward: read the gradient, write the input's (the
    # residual's gradient is the incoming one); the bias gradient's reduction is not counted.
    row("bias_dropout_add fwd+bwd (p 0.1)", 5 * n * h * es, {
        "megatron_ext": dropout_fwd_bwd(fusions.bias_dropout_add_fused_train),
        "megatron-core": mc("bias_dropout_add_fused_train", dropout_fwd_bwd),
    }, compare=None)
    x = r = gh = None

    # Vocab-parallel cross-entropy forward + backward at tp 1 on [tokens, vocab] logits: each rep
    # starts from a fresh copy (megatron-core overwrites float32 logits in place).
    logits = randn(n, vocab)
    target = torch.randint(0, vocab, (n,), device=device, generator=gen)
    grad_loss = torch.rand(n, device=device, generator=gen)

    def cross_entropy(f: Callable) -> Variant:
        return (lambda: logits.detach().clone().requires_grad_(),
                lambda z: f(z, target).backward(grad_loss))

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh(device.type, (1,))

    def dtensor_step(z: torch.Tensor) -> None:
        # loss_parallel's backward must run inside its context.
        with loss_parallel():
            loss = F.cross_entropy(DTensor.from_local(z, mesh, [Shard(1)]), target, reduction="none")
            loss.full_tensor().backward(grad_loss)

    # Logits read in the forward and again in the backward, their gradient written.
    row("cross_entropy fwd+bwd", 3 * n * vocab * es, {
        "megatron_ext": cross_entropy(tensor_parallel.vocab_parallel_cross_entropy),
        "megatron_ext overwrite_logits": cross_entropy(
            lambda z, t: tensor_parallel.vocab_parallel_cross_entropy(z, t, overwrite_logits=True)),
        "megatron-core": mc("vocab_parallel_cross_entropy", cross_entropy),
        "DTensor loss_parallel": (cross_entropy(None)[0], dtensor_step),
    }, compare="grad")
    logits = None

    # RMSNorm, rotary embedding and SwiGLU at Llama's sizes (q of 128-lane heads, SwiGLU width
    # 8h/3 rounded up to 256 as Llama 7B's 11008): each kernel alone, for its share of the copy
    # bandwidth, then forward + backward through autograd against megatron-core's path without
    # TransformerEngine (torch.nn.RMSNorm, which its WrappedTorchNorm builds; its unfused rotary
    # chain; its torch.compile'd SwiGLU). The fwd+bwd runs hand the output's gradient to a fresh
    # input with torch.autograd.grad (no AccumulateGrad copy) and return the input's gradient.
    def fwd_bwd(fn: Callable, source: torch.Tensor, grad: torch.Tensor,
                params: tuple[torch.Tensor, ...] = ()) -> Variant:
        return (lambda: source.detach().clone().requires_grad_(),
                lambda leaf: torch.autograd.grad(fn(leaf), (leaf, *params), grad)[0])

    eps = 1e-5
    x, gx = randn(n, h), randn(n, h)
    w = (1 + 0.1 * randn(h)).detach().requires_grad_()
    with torch.no_grad():
        _, rstd = ops.rms_norm_forward(x, w, eps)
        row("rms_norm fwd", (2 * n * h + h) * es + 4 * n, {
            "megatron_ext": plain(lambda: ops.rms_norm_forward(x, w, eps)[0]),
            "torch.nn.RMSNorm": plain(lambda: F.rms_norm(x, (h,), w, eps)),
        })
        row("rms_norm bwd", (3 * n * h + 2 * h) * es + 4 * n, {
            "megatron_ext": plain(lambda: ops.rms_norm_backward(gx, x, w, rstd)[0]),
        })
    row("rms_norm fwd+bwd", 5 * n * h * es, {
        "megatron_ext": fwd_bwd(lambda t: fusions.fused_rms_norm(t, w, eps), x, gx, (w,)),
        "torch.nn.RMSNorm": fwd_bwd(lambda t: F.rms_norm(t, (h,), w, eps), x, gx, (w,)),
    })
    x = gx = rstd = None

    d = min(128, h)
    q, gq = randn(n, 1, h // d, d), randn(n, 1, h // d, d)
    freqs = _freqs(n, d, False).to(device)
    cos, sin = torch.cos(freqs).view(n, d).to(dtype), torch.sin(freqs).view(n, d).to(dtype)
    table = 2 * n * d * es  # cos and sin
    with torch.no_grad():
        row("rotary fwd", 2 * q.numel() * es + table, {
            "megatron_ext": plain(lambda: ops.rotary_pos_emb_forward(q, cos, sin, False)),
            "megatron-core": mc("_apply_rotary_pos_emb_bshd", lambda f: plain(lambda: f(q, freqs))),
        })
        row("rotary bwd", 2 * q.numel() * es + table, {
            "megatron_ext": plain(lambda: ops.rotary_pos_emb_backward(gq, cos, sin, False)),
        })
    row("rotary fwd+bwd", 4 * q.numel() * es, {
        "megatron_ext": fwd_bwd(lambda t: fusions.fused_apply_rotary_pos_emb(t, freqs), q, gq),
        "megatron-core": mc("_apply_rotary_pos_emb_bshd", lambda f: fwd_bwd(lambda t: f(t, freqs), q, gq)),
    })
    q = gq = cos = sin = freqs = None

    f = 256 * -(-8 * h // (3 * 256))
    y, gy = randn(n, 2 * f), randn(n, f)

    with torch.no_grad():
        row("swiglu fwd", 3 * n * f * es, {
            "megatron_ext": plain(lambda: ops.swiglu_forward(y, None)),
            "megatron-core": mc("bias_swiglu_impl", lambda fn: plain(lambda: fn(y, None))),
            "torch F.silu(gate) * up": plain(lambda: _unfused_swiglu(y)),
        })
        row("swiglu bwd", 5 * n * f * es, {
            "megatron_ext": plain(lambda: ops.swiglu_backward(gy, y, None)),
        })
    row("swiglu fwd+bwd", 8 * n * f * es, {
        "megatron_ext": fwd_bwd(fusions.swiglu, y, gy),
        "megatron-core": mc("bias_swiglu_impl", lambda fn: fwd_bwd(lambda t: fn(t, None), y, gy)),
        "torch F.silu(gate) * up": fwd_bwd(_unfused_swiglu, y, gy),
    })
    y = gy = None

    # The weight-gradient GEMM of gradient_accumulation_fusion ([h, 4h] += go^T inp) as the linear
    # layers run it: 16-bit operands into the fp32 main_grad in one cuBLAS call, against a 16-bit
    # GEMM followed by an fp32 add (the path without the fusion) and against fp32 operand copies.
    gemm = None
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        go, inp = randn(n, h), randn(n, ffn)
        main_grad = torch.zeros(h, ffn, device=device, dtype=torch.float32)
        flops = 2 * n * h * ffn
        stats = time_variants({
            "megatron_ext (addmm into fp32)": plain(
                lambda: torch.addmm(main_grad, go.t(), inp, out_dtype=torch.float32, out=main_grad)),
            "16-bit GEMM, then fp32 add": plain(lambda: main_grad.add_(go.t() @ inp)),
            "fp32 operand copies": plain(lambda: main_grad.addmm_(go.t().float(), inp.float())),
        }, args.reps, device)
        for s in stats.values():
            s["tflops"] = flops / s["median_ms"] / 1e9
        gemm = {"op": f"wgrad [{h}, {ffn}] += [{n}, {h}]^T [{n}, {ffn}]", "flops": flops, "variants": stats}

    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    result = {
        "device": props.name if props else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron_core_version() if mcore else None,
        "megatron_ext_build": megatron_ext.build_info(),
        "dtype": args.dtype,
        "tokens": n,
        "hidden": h,
        "vocab": vocab,
        "reps": args.reps,
        "copy_bandwidth_gbps": copy_gbps,
        "rows": rows,
        "gemm": gemm,
        "method": "variants interleaved rep by rep in a rotating order, first rep a warm-up; CUDA events "
                  "around one call; min/median/max over reps; GB/s = bytes the op must move / median",
    }
    ps.destroy_model_parallel()
    if mcore:
        from megatron.core import parallel_state as mps

        mps.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def print_table(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}, megatron-core {result['megatron_core']}, "
          f"{result['dtype']}, tokens {result['tokens']}, hidden {result['hidden']}, vocab {result['vocab']}")
    if result["copy_bandwidth_gbps"]:
        print(f"device-to-device copy: {result['copy_bandwidth_gbps']:.0f} GB/s (read + write)")
    header = (f"{'op':34s} {'variant':30s} {'min':>8s} {'median':>8s} {'max':>8s} {'GB/s':>7s} "
              f"{'% copy':>7s} {'peak MiB':>9s} {'vs first':>9s} {'max |diff|':>11s}")
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        first = next(iter(r["variants"].values()))
        for i, (name, s) in enumerate(r["variants"].items()):
            share = f"{100 * s['share_of_copy_bw']:6.1f}%" if s["share_of_copy_bw"] else f"{'-':>7s}"
            peak = f"{s['peak_extra_mib']:9.1f}" if s["peak_extra_mib"] is not None else f"{'-':>9s}"
            print(f"{r['op'] if i == 0 else '':34s} {name:30s} {s['min_ms']:8.3f} {s['median_ms']:8.3f} "
                  f"{s['max_ms']:8.3f} {s['gbps']:7.0f} {share} {peak} "
                  f"{s['median_ms'] / first['median_ms']:8.2f}x "
                  + (f"{s['max_abs_diff']:11.2e}" if s["max_abs_diff"] is not None else f"{'-':>11s}"))
    if result["gemm"]:
        print(result["gemm"]["op"])
        for name, s in result["gemm"]["variants"].items():
            print(f"  {name:32s} {s['min_ms']:8.3f} {s['median_ms']:8.3f} {s['max_ms']:8.3f} ms "
                  f"{s['tflops']:6.0f} TFLOP/s")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tokens", type=int, default=8192, help="sequence x micro-batch rows")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary columns on this rank")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--without-megatron-core", action="store_true", help="only megatron_ext's rows")
    p.add_argument("--json", default="runs/gpu_bench.json")
    args = p.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (or --device cpu to check the script)")
        if not megatron_ext.build_info()["cuda_compiled"]:
            raise SystemExit("megatron_ext was built without CUDA: rebuild with FORCE_CUDA=1")
    if not args.without_megatron_core and import_megatron_core() is None:
        raise SystemExit(
            f"megatron-core is not importable. Install it beside this torch with `pip install --no-deps "
            f"megatron-core=={MEGATRON_CORE_VERSION}`; on a machine without internet, download its wheel "
            f"elsewhere into .whl/ (docs/gpu.md) and ./dev.sh gpu installs it; or pass "
            f"--without-megatron-core")
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
