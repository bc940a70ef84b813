"""What every benchmark here shares: timing variants interleaved rep by rep, peak extra resident
memory, the peers (megatron-core 0.16.1 when installed, DTensor), the summary table and JSON.

Timing: each repetition runs every variant once, in a rotating order, after a barrier; a
variant's time in a repetition is that of the slowest rank (the step's time); min, median and
max are over repetitions. The first repetition is a warm-up and is not counted.

Peak extra memory: before each run the process's resident-set high-water mark is reset
(``echo 5 > /proc/self/clear_refs``, Linux); after the run, the high-water mark (``VmHWM``)
minus the resident size just before the run (``VmRSS``) is what the run added at its peak,
inputs excluded, everything it allocates included (its gradients too). torch's CPU allocator
returns large blocks to the system when they are freed, so the resident size tracks live
tensors. The figure is the largest over repetitions and ranks.

CPU time: the process's CPU seconds during the run (``time.process_time``, every thread, gloo's
included), the slowest rank per repetition, median over repetitions. On a shared machine wall
times also hold the time other processes ran; CPU seconds do not, so both are reported.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
MIB = 2**20
MEGATRON_CORE_VERSION = "0.16.1"


def memory_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_interleaved(variants: dict[str, Callable[..., Any]], reps: int,
                    prepare: Callable[[], Any] | None = None) -> dict[str, dict[str, list[float]]]:
    """Runs every variant once per repetition (plus one warm-up), in rotating order, each after a
    barrier over the default group. Returns this rank's times (s) and peak extra memory (MiB).
    With ``prepare``, every run is called with a fresh ``prepare()`` (its inputs), made before the
    barrier, outside the run's time and memory."""
    names = list(variants)
    out = {name: {"times_s": [], "cpu_s": [], "peak_extra_mib": []} for name in names}
    for rep in range(reps + 1):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            args = () if prepare is None else (prepare(),)
            dist.barrier()
            reset_peak_rss()
            before = memory_kib("VmRSS")
            start, cpu_start = time.perf_counter(), time.process_time()
            variants[name](*args)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            peak = memory_kib("VmHWM")
            del args
            if rep > 0:
                out[name]["times_s"].append(elapsed)
                out[name]["cpu_s"].append(cpu)
                out[name]["peak_extra_mib"].append((peak - before) / 1024)
    return out


def summarize(per_rank: list[dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, float]]:
    """Per variant: min/median/max over repetitions of the slowest rank's time, and the largest
    peak extra memory of any rank and repetition."""
    summary = {}
    for name in per_rank[0]:
        step = [max(ts) for ts in zip(*(r[name]["times_s"] for r in per_rank))]
        cpu = [max(ts) for ts in zip(*(r[name]["cpu_s"] for r in per_rank))]
        summary[name] = {
            "min_s": min(step),
            "median_s": statistics.median(step),
            "max_s": max(step),
            "peak_extra_mib": max(max(r[name]["peak_extra_mib"]) for r in per_rank),
            "cpu_median_s": statistics.median(cpu),
            "step_times_s": step,
            "step_cpu_s": cpu,
        }
    return summary


def print_table(title: str, summary: dict[str, dict[str, float]], baseline: str | None = None,
                unit: str = "ms") -> None:
    """The summary as a table; with ``baseline``, each variant's median time and peak extra
    memory divided by the baseline's."""
    scale = 1e3 if unit == "ms" else 1.0
    print(title)
    header = f"{'variant':<24} {'min':>9} {'median':>9} {'max':>9} {'cpu median':>11} {'peak extra':>11}"
    if baseline:
        header += f" {'time ratio':>11} {'cpu ratio':>11} {'memory ratio':>13}"
    print(header + f"   ({unit}, MiB per rank; ratios to {baseline})" if baseline else header)
    b = summary.get(baseline) if baseline else None
    for name, s in summary.items():
        line = (f"{name:<24} {s['min_s'] * scale:>9.2f} {s['median_s'] * scale:>9.2f} "
                f"{s['max_s'] * scale:>9.2f} {s['cpu_median_s'] * scale:>11.2f} {s['peak_extra_mib']:>11.1f}")
        if b is not None:
            mem = f"{s['peak_extra_mib'] / b['peak_extra_mib']:.3f}" if b["peak_extra_mib"] > 0 else "-"
            line += (f" {s['median_s'] / b['median_s']:>11.2f} "
                     f"{s['cpu_median_s'] / b['cpu_median_s']:>11.2f} {mem:>13}")
        print(line)


def write_json(name: str, payload: dict[str, Any], path: str | None = None) -> str:
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "megatron_core": megatron_core_version(),
        "device": "cpu",
        "backend": "gloo",
        "threads_per_rank": 1,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "timing_method": "variants interleaved rep by rep after a barrier, slowest rank per rep, first rep "
                         "a warm-up; min/median/max over reps; cpu = process CPU seconds, slowest rank per "
                         "rep, median",
        "memory_method": "VmHWM after clear_refs=5 minus VmRSS just before the run; max over reps and ranks",
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=2)
    print(f"wrote {path}")
    return path


def megatron_core_version() -> str | None:
    """The importable megatron-core's version (installed, or a source tree on the path)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.package_info import __version__
        except ImportError:
            return None
    return __version__


def import_megatron_core():
    """``(parallel_state, tensor_parallel, ModelParallelConfig)`` of megatron-core, or None when it
    is not importable. It runs on CPU with gloo as it is; its warnings about missing Apex and
    Transformer Engine are silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.model_parallel_config import ModelParallelConfig
        except ImportError:
            return None
    return parallel_state, tensor_parallel, ModelParallelConfig


def require_megatron_core(allow_missing: bool) -> None:
    """Exits with a message when megatron-core is missing, unless the caller allows it."""
    if import_megatron_core() is None and not allow_missing:
        sys.exit(f"megatron-core is not importable: run through `./dev.sh bench NAME` (which installs "
                 f"megatron-core=={MEGATRON_CORE_VERSION}) or pass --without-megatron-core")


def live_cpu_storages() -> dict[int, int]:
    """Bytes of every distinct CPU storage alive, by its address (after a garbage collection).
    A DTensor (PyTorch's FSDP2) is a wrapper without storage: its local tensor is counted; fake
    tensors (left by torch.compile in the same process) hold no memory."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    gc.collect()
    out = {}
    with warnings.catch_warnings():  # (isinstance on some of torch's deprecated objects warns)
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu" and not isinstance(obj, (DTensor, FakeTensor)):
            try:
                storage = obj.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # another tensor subclass without data (a functional tensor)
                continue
    return out
