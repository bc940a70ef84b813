"""The whole training step on one GPU: megatron_ext's GPTModel against Megatron-core 0.16.1's own
GPTModel (its local layer spec: no TransformerEngine, no apex), each with its own
DistributedDataParallel (``grad_reduce_in_fp32``), ``get_megatron_optimizer`` (Adam, clip 1.0,
weight decay 0.01), its learning-rate scheduler where it needs one, and ``get_forward_backward_func``
over the micro-batches; bf16 parameters with float32 main weights. Both start from the same weights
(megatron_ext's model copies Megatron-core's) and see the same batches; their steps are interleaved
(a rotating order per repetition, the first repetition a warm-up).

megatron_ext runs with its fused kernels (bias + GeLU / SwiGLU, bias + dropout + add, RMSNorm,
rotary), SDPA and gradient-accumulation fusion; Megatron-core with the fusions it has without
TransformerEngine or apex (its ``torch.compile``d bias + activation and bias + dropout + add) and its
unfused attention.

Shapes (``--shapes``): ``gpt`` (16 layers x 2048, 16 heads, LayerNorm, GeLU, biases, learned
positions, tied embedding), ``llama`` (16 x 2048, 16 heads / 4 groups, ffn 5632, RMSNorm, SwiGLU,
rotary, untied output layer) at sequence 2048, and ``llama7b`` (Llama 7B's layer shape: 8 x 4096, 32
heads / 8 groups, ffn 11008) at sequence 4096; 16,384 tokens per step each, vocabulary 32,000.

Reported per stack and shape: step time (min / median / max over repetitions), tokens/s, TFLOP/s
by 6 N + 12 L h s FLOPs per token (N: the parameters that multiply activations, the output layer
included and the input embedding lookup not; full attention, no causal discount), MFU against the
device's bf16 dense peak (``PEAK_TFLOPS`` by device name, or ``--peak-tflops``), the largest
difference of a step's loss from Megatron-core's, state memory (what the model, its gradient
buffers and the optimizer state hold after the first step: ``torch.cuda.memory_allocated`` growth
on a GPU, the bytes of the distinct tensor storages alive on the CPU) and peak extra memory of a
step (``max_memory_allocated`` minus what was allocated before the step; on the CPU the resident
high-water mark, benchmarks/common.py). Then megatron_ext's model alone under each recomputation
mode of ``--recompute`` (the same model, its config switched): median step time and peak extra
memory. Before those, ``--profile`` steps of each stack under torch.profiler: GPU kernel time per
step by category (``TIME_CATEGORIES``: GEMMs, attention, the optimizer, each fused kernel, copies
and fills, ...; on the CPU the operators' self time) and how often the host waits for the device
per step.

``--device cpu`` runs the same code on one CPU process at a tiny size (``--shapes tiny``), to check
the script; its figures are not GPU figures. Without megatron-core importable the script stops,
unless ``--without-megatron-core``.

    python benchmarks/gpu_step.py [--shapes gpt llama llama7b] [--reps 10] [--json runs/gpu_step.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import MEGATRON_CORE_VERSION, import_megatron_core, memory_kib, megatron_core_version  # noqa: E402
from common import live_cpu_storages, reset_peak_rss  # noqa: E402
from megatron_core_gpt import Run, batches, build_model, config_fields, copy_weights, cpu_patches  # noqa: E402
from megatron_core_gpt import forward_step  # noqa: E402

# bf16 dense tensor-core peaks (TFLOP/s, without sparsity), matched against the device name in order.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)

SHAPES = {
    "gpt": dict(arch="gpt", layers=16, hidden=2048, heads=16, query_groups=16, ffn=8192, seq=2048,
                vocab=32000, micro_batch=2),
    "llama": dict(arch="llama", layers=16, hidden=2048, heads=16, query_groups=4, ffn=5632, seq=2048,
                  vocab=32000, micro_batch=2),
    "llama7b": dict(arch="llama", layers=8, hidden=4096, heads=32, query_groups=8, ffn=11008, seq=4096,
                    vocab=32000, micro_batch=1),
    # The CPU check of the script.
    "tiny": dict(arch="llama", layers=2, hidden=64, heads=4, query_groups=2, ffn=128, seq=32, vocab=128,
                 micro_batch=2),
}

RECOMPUTE_MODES = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective-mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective-layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective-all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "mlp", "layernorm"]),
}

STACKS = ("megatron-core", "megatron_ext")

# Kernel (CUDA) or operator (CPU) names by category, the first match deciding; names are matched
# lower-cased. What matches none is "other".
TIME_CATEGORIES = (
    ("cross-entropy", ("cross_entropy", "log_softmax", "nll", "row_stats_kernel", "::grad_kernel")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("rotary", ("rotary",)),
    ("swiglu", ("swiglu", "silu")),
    ("norm", ("rms_norm", "layer_norm", "layernorm")),
    ("gelu, bias, dropout", ("gelu", "dropout", "bias")),
    ("reductions", ("reduce", "norm")),
    ("copies and fills", ("copy", "memcpy", "memset", "fill", "cast", "cat", "zero")),
)
# The CUDA runtime calls with which the host waits for the device.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def time_category(name: str) -> str:
    lowered = name.lower()
    return next((cat for cat, keys in TIME_CATEGORIES if any(k in lowered for k in keys)), "other")


def profile_steps(stack: "Stack", steps: int) -> dict[str, Any]:
    """``steps`` steps under torch.profiler: GPU kernel time (on the CPU, operators' self time) per
    step by category, and the host's waits for the device per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = stack.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(stack.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            stack.step()
        _sync(stack.device)  # the kernels' records complete; this wait is not counted below
    categories: dict[str, float] = {cat: 0.0 for cat, _ in TIME_CATEGORIES}
    categories["other"] = 0.0
    waits = 0
    for e in prof.events():
        if cuda and e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            # (a user annotation is a record_function range on the GPU's timeline, not a kernel)
            categories[time_category(e.name)] += e.time_range.elapsed_us() / 1e3 / steps  # the kernel's
        elif not cuda and e.device_type == DeviceType.CPU:
            categories[time_category(e.name)] += e.self_cpu_time_total / 1e3 / steps
        waits += e.name in HOST_WAITS
    if cuda:
        waits -= 1  # the closing _sync's cudaDeviceSynchronize
    return {"ms_per_step": categories, "total_ms": sum(categories.values()),
            "host_waits_per_step": waits / steps}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's bf16 dense peak: ``override``, else the table's entry for its name."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def flops_per_token(model: torch.nn.Module, run: Run) -> float:
    """6 N + 12 L h s: N the parameters that multiply activations (the input embedding and the
    learned positions are lookups; a tied embedding counts once, as the output layer)."""
    tied = run.arch == "gpt"
    n = 0
    for name, p in model.named_parameters():
        lookup = "position_embeddings" in name or ("word_embeddings" in name and not tied)
        n += 0 if lookup else p.numel()
    return 6.0 * n + 12.0 * run.layers * run.hidden * run.seq


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    """Bytes held by tensors: the CUDA allocator's count, or the distinct CPU storages alive."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return sum(live_cpu_storages().values())


class Stack:
    """One library's model (DDP-wrapped), optimizer, scheduler and config, set up as Megatron-LM's
    training loop sets them up."""

    def __init__(self, name: str, run: Run, device: torch.device, fused: bool,
                 weights_from: torch.nn.Module | None = None) -> None:
        import importlib

        module = "megatron.core" if name == "megatron-core" else "megatron_ext"
        self.name, self.run, self.device = name, run, device
        self.ps = importlib.import_module(f"{module}.parallel_state")
        tensor_parallel = importlib.import_module(f"{module}.tensor_parallel")
        distributed = importlib.import_module(f"{module}.distributed")
        optim = importlib.import_module(f"{module}.optimizer")
        self.schedules = importlib.import_module(f"{module}.pipeline_parallel")
        if not self.ps.model_parallel_is_initialized():
            self.ps.initialize_model_parallel(1, 1)
        cpu_core = name == "megatron-core" and device.type == "cpu"
        tensor_parallel.model_parallel_cuda_manual_seed(
            run.seed, **({"inference_rng_tracker": True} if cpu_core else {}), force_reset_rng=True)
        torch.manual_seed(run.seed)
        ext = name == "megatron_ext"
        fields = config_fields(run)
        fields.update(
            params_dtype=run.dtype, pipeline_dtype=run.dtype, bf16=run.dtype == torch.bfloat16,
            # Megatron-core's bias + activation and bias + dropout + add fusions are torch.compile'd
            # (CUDA); its rotary and norm fusions need TransformerEngine / apex.
            bias_activation_fusion=fused and (ext or device.type == "cuda"),
            bias_dropout_fusion=fused and (ext or device.type == "cuda"),
            apply_rope_fusion=fused and ext and run.arch == "llama",
            persist_layer_norm=fused and ext and run.arch == "llama",
            gradient_accumulation_fusion=fused and ext,
            # On a GPU the weights start there (megatron_ext's are then Megatron-core's anyway).
            use_cpu_initialization=device.type == "cpu",
        )
        self.config = importlib.import_module(f"{module}.transformer").TransformerConfig(**fields)
        before = _allocated(device)
        (model,) = build_model(run, self.config, module)
        if weights_from is not None:
            copy_weights(weights_from, model)
        # Megatron-LM's Float16Module: the whole model in the 16-bit dtype (Megatron-core's local
        # spec builds its torch norms in the default dtype).
        model.to(device=device, dtype=run.dtype)
        ddp_config = distributed.DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
        self.model = distributed.DistributedDataParallel(self.config, ddp_config, model)
        self.optimizer = optim.get_megatron_optimizer(
            optim.OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.01, clip_grad=1.0,
                                  bf16=run.dtype == torch.bfloat16, params_dtype=run.dtype),
            [self.model])
        self.scheduler = None
        if not ext:  # Megatron-core's groups get their learning rate from its scheduler
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=run.lr, max_lr=run.lr, min_lr=run.lr, lr_warmup_steps=0,
                lr_decay_steps=1000, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
                wd_incr_steps=1000, wd_incr_style="constant")
        self.config.finalize_model_grads_func = distributed.finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.flops_per_token = flops_per_token(model, run)
        self.losses: list[float] = []
        _sync(device)
        self.state_bytes = _allocated(device) - before  # the model and its gradient buffers

    def first_step(self) -> None:
        """The first step, which allocates the optimizer state (counted into ``state_bytes``)."""
        before = _allocated(self.device)
        self.step()
        _sync(self.device)
        self.state_bytes += _allocated(self.device) - before

    def step(self) -> float:
        """One global step over ``run.global_batch / run.micro_batch`` micro-batches; the loss
        (the host waits for it: the step's one synchronisation)."""
        run = self.run
        micro = [tuple(t.to(self.device) for t in mb) for mb in batches(run, len(self.losses), 0, 1)]
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.schedules.get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
            num_microbatches=len(micro), seq_length=run.seq, micro_batch_size=run.micro_batch,
            forward_only=False)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step(increment=1)
        loss = float(torch.stack([m["lm loss"] for m in losses]).float().mean())
        self.losses.append(loss)
        return loss


def _measure(stack: Stack) -> tuple[float, float]:
    """One step: (seconds, peak extra MiB)."""
    device = stack.device
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        reset_peak_rss()
        before = memory_kib("VmRSS") * 1024
    start = time.perf_counter()
    stack.step()  # ends with the loss on the host: the device has finished the step
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else memory_kib("VmHWM") * 1024
    # On the CPU the kernel's resident-set counters lag by a few pages (proc(5): VmRSS is
    # inaccurate), so a step that adds nothing can read a few KiB below zero.
    return seconds, max(0, peak - before) / 2**20


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, peak: float | None) -> dict:
    spec = SHAPES[shape]
    microbatches = args.microbatches
    run = Run(**spec, dtype=getattr(torch, args.dtype), global_batch=spec["micro_batch"] * microbatches,
              steps=args.reps + 2, lr=1e-4, optimizer="adam")
    tokens = run.global_batch * run.seq
    names = [n for n in STACKS if n == "megatron_ext" or not args.without_megatron_core]
    stacks: dict[str, Stack] = {}
    for name in names:  # megatron_ext's model starts from Megatron-core's initial weights
        source = stacks["megatron-core"].model.module if "megatron-core" in stacks else None
        stacks[name] = Stack(name, run, device, fused=not args.unfused, weights_from=source)
    for stack in stacks.values():
        stack.first_step()
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps + 1):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, extra = _measure(stacks[name])
            if rep > 0:
                times[name].append(seconds)
                peaks[name].append(extra)
    result: dict[str, Any] = {"tokens_per_step": tokens, "run": {k: str(v) for k, v in run.__dict__.items()},
                              "stacks": {}}
    for name in names:
        s = stacks[name]
        t = _stats(times[name])
        tflops = s.flops_per_token * tokens / t["median"] / 1e12
        difference = None
        if "megatron-core" in stacks:
            reference = stacks["megatron-core"].losses
            difference = max(abs(a - b) for a, b in zip(s.losses, reference))
        result["stacks"][name] = {
            "step_s": t, "tokens_per_s": tokens / t["median"], "tflops": tflops,
            "mfu": None if peak is None else tflops / peak, "flops_per_token": s.flops_per_token,
            "state_gib": s.state_bytes / 2**30, "peak_extra_gib": max(peaks[name]) / 1024,
            "losses": list(s.losses), "max_loss_difference": difference,
        }
    if "megatron-core" in stacks:
        core = result["stacks"]["megatron-core"]["step_s"]["median"]
        result["speedup"] = core / result["stacks"]["megatron_ext"]["step_s"]["median"]
    if args.profile:
        result["profile"] = {name: profile_steps(stacks[name], args.profile) for name in names}
    # Recomputation modes: megatron_ext's model alone, its config switched between steps.
    ext = stacks["megatron_ext"]
    del stacks
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["recompute"] = {}
    for mode in args.recompute:
        for key, value in RECOMPUTE_MODES[mode].items():
            setattr(ext.config, key, value)
        measured = [_measure(ext) for _ in range(args.recompute_reps + 1)][1:]
        result["recompute"][mode] = {
            "step_s": statistics.median(m[0] for m in measured),
            "peak_extra_gib": max(m[1] for m in measured) / 1024,
        }
    return result


def print_table(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}, megatron-core {result['megatron_core']}, "
          f"{result['dtype']}, peak {result['peak_tflops']} TFLOP/s")
    header = (f"{'shape':10s} {'stack':14s} {'min ms':>8s} {'median ms':>10s} {'max ms':>8s} "
              f"{'tokens/s':>10s} "
              f"{'TFLOP/s':>8s} {'MFU':>6s} {'peak extra GiB':>15s} {'state GiB':>10s} {'loss diff':>10s}")
    print(header)
    print("-" * len(header))
    for shape, r in result["shapes"].items():
        if "error" in r:
            print(f"{shape:10s} {r['error']}")
            continue
        for name, s in r["stacks"].items():
            mfu = f"{100 * s['mfu']:5.1f}%" if s["mfu"] is not None else f"{'-':>6s}"
            diff = s["max_loss_difference"]
            diff = f"{diff:10.2e}" if diff is not None else f"{'-':>10s}"
            t = {k: 1e3 * v for k, v in s["step_s"].items()}
            print(f"{shape:10s} {name:14s} {t['min']:8.1f} {t['median']:10.1f} "
                  f"{t['max']:8.1f} {s['tokens_per_s']:10.0f} {s['tflops']:8.2f} {mfu} "
                  f"{s['peak_extra_gib']:15.3f} {s['state_gib']:10.3f} {diff}")
        if "speedup" in r:
            print(f"{shape:10s} megatron_ext step {r['speedup']:.2f}x faster than megatron-core")
        for name, prof in r.get("profile", {}).items():
            parts = ", ".join(f"{cat} {ms:.1f}" for cat, ms in prof["ms_per_step"].items() if ms > 0)
            unit = "kernel" if result["device"] != "cpu" else "operator"
            print(f"{shape:10s} {name:14s} {unit} ms per step {prof['total_ms']:.1f}: {parts}; "
                  f"host waits per step {prof['host_waits_per_step']:g}")
        for mode, m in r["recompute"].items():
            print(f"{shape:10s} megatron_ext recompute {mode:20s} {1e3 * m['step_s']:10.1f} ms "
                  f"peak extra {m['peak_extra_gib']:.3f} GiB")


def markdown_table(result: dict) -> str:
    """The comparison as the README's table: one row per shape, megatron_ext against
    Megatron-core, with the device, torch version and date of the run above it."""
    lines = [
        f"{result['device']}, torch {result['torch']}, megatron-core {result['megatron_core']}, "
        f"{result['dtype']}, measured {result['date']}; median step (min-max) of {result['reps']}",
        "",
        "| shape | megatron_ext step | megatron-core step | speed-up | MFU ext / core "
        "| peak extra memory ext / core | state memory ext / core |",
        "|---|---|---|---|---|---|---|",
    ]

    def step(s: dict) -> str:
        t = {k: 1e3 * v for k, v in s["step_s"].items()}
        return f"{t['median']:.0f} ms ({t['min']:.0f}-{t['max']:.0f})"

    for shape, r in result["shapes"].items():
        if "error" in r:
            lines.append(f"| {shape} | {r['error']} | | | | | |")
            continue
        ext, core = r["stacks"]["megatron_ext"], r["stacks"].get("megatron-core")

        def pair(key: str, fmt: str) -> str:
            values = [s[key] for s in (ext, core) if s is not None]
            return " / ".join("-" if v is None else format(v, fmt) for v in values)

        core_step, speedup = (step(core), f"{r['speedup']:.2f}x") if core else ("-", "-")
        lines.append(
            f"| {shape}, {r['tokens_per_step']} tokens | {step(ext)} | {core_step} | {speedup} "
            f"| {pair('mfu', '.1%')} | {pair('peak_extra_gib', '.1f')} GiB | {pair('state_gib', '.1f')} GiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES),
                   help="default: gpt llama llama7b (cuda), tiny (cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--recompute", nargs="*", default=["none", "selective", "selective-all", "full"],
                   choices=list(RECOMPUTE_MODES), help="megatron_ext's recomputation modes to measure after")
    p.add_argument("--recompute-reps", type=int, default=3)
    p.add_argument("--profile", type=int, default=2, metavar="STEPS",
                   help="profile this many steps of each stack (0: none)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 dense peak")
    p.add_argument("--unfused", action="store_true", help="both stacks without their fusions")
    p.add_argument("--without-megatron-core", action="store_true", help="megatron_ext only")
    p.add_argument("--json", default="runs/gpu_step.json")
    p.add_argument("--markdown", metavar="JSON", default=None,
                   help="print the README table of an earlier run's JSON, and run nothing")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            result = json.load(f)
        print(markdown_table(result))
        return result
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu_step.py needs a CUDA GPU (or --device cpu to check the script)")
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if not args.without_megatron_core and import_megatron_core() is None:
        raise SystemExit(
            f"megatron-core is not importable: `pip install --no-deps megatron-core=={MEGATRON_CORE_VERSION} "
            f"einops` (./dev.sh gpu installs it from .whl/), or pass --without-megatron-core")
    if device.type == "cpu" and not args.without_megatron_core:
        cpu_patches(full=True)
    shapes = args.shapes or (["gpt", "llama", "llama7b"] if device.type == "cuda" else ["tiny"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    peak = peak_tflops(device, args.peak_tflops)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "megatron_core": None if args.without_megatron_core else megatron_core_version(),
        "dtype": args.dtype, "peak_tflops": peak, "reps": args.reps,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "shapes": {},
    }
    try:
        for shape in shapes:
            try:
                result["shapes"][shape] = run_shape(shape, args, device, peak)
            except torch.OutOfMemoryError as e:  # e.g. llama7b with both stacks on an 80 GB GPU
                result["shapes"][shape] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                print(f"{shape}: out of memory, skipped", file=sys.stderr)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            _write(result, args.json)  # what is measured so far survives a later failure
    finally:
        dist.destroy_process_group()
    print_table(result)
    _write(result, args.json)
    return result


def _write(result: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
