"""Fused RMSNorm, rotary embedding and SwiGLU forward+backward on one CPU thread, against the torch-op
chains megatron-core 0.16.1 runs for them without TransformerEngine, in the same run:

* RMSNorm [s, b, h]: megatron_ext's ``fused_rms_norm`` against ``torch.nn.RMSNorm``, the module
  megatron-core's ``WrappedTorchNorm`` builds for ``normalization="RMSNorm"`` (built through it);
* rotary embedding of q [s, b, n, d] (halves and interleaved): ``fused_apply_rotary_pos_emb``
  against megatron-core's ``_apply_rotary_pos_emb_bshd`` (its path without ``apply_rope_fusion``);
* SwiGLU [tokens, 2 ffn] (no bias, as Llama): megatron_ext's ``swiglu`` against megatron-core's
  ``bias_swiglu_impl`` (its ``bias_activation_fusion`` path: an autograd function over
  ``torch.compile``d chains) and against its MLP's unfused ``F.silu(gate) * up``.

Every run gets fresh inputs made by an op outside its time and memory; the output's gradient is
handed on with ``torch.autograd.grad`` to the inputs (the weight included), as a layer's backward
hands it to its producer: no ``AccumulateGrad`` copy is made. Timing and memory method:
benchmarks/common.py (the first rep, a warm-up, also compiles megatron-core's ``torch.compile``d
SwiGLU). Each variant's largest difference from the first one (output and input gradient,
relative to their largest value) is reported beside its time.

    ./dev.sh bench llama_kernels [--dtypes float32 bfloat16] [--seq 2048] [--batch 2] [--hidden 4096]
        [--heads 32] [--head-dim 128] [--tokens 4096] [--ffn 11008] [--reps 5] [--without-megatron-core]
"""

from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from common import (
    import_megatron_core,
    print_table,
    require_megatron_core,
    run_interleaved,
    summarize,
    write_json,
)

from megatron_ext.fusions import fused_apply_rotary_pos_emb, fused_rms_norm, swiglu
from tests.distributed import run_distributed

EPS = 1e-5


def _megatron_core():
    """megatron-core's functions compared here, or None when it is not importable."""
    if import_megatron_core() is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_config import TransformerConfig
    return SimpleNamespace(bias_swiglu_impl=bias_swiglu_impl, rope=_apply_rotary_pos_emb_bshd,
                           WrappedTorchNorm=WrappedTorchNorm, TransformerConfig=TransformerConfig)


def _rms_norm_module(mcore, hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    if mcore is None:
        norm = torch.nn.RMSNorm(hidden, eps=EPS)
    else:
        config = mcore.TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                                         normalization="RMSNorm", layernorm_epsilon=EPS)
        norm = mcore.WrappedTorchNorm(config, hidden, eps=EPS)
        assert isinstance(norm, torch.nn.RMSNorm)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    return norm.to(dtype)


def _freqs(s: int, d: int, interleaved: bool) -> torch.Tensor:
    """Megatron-core's rotary angles [s, 1, 1, d] (RotaryEmbedding.get_emb, base 10000), float32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return emb[:, None, None, :]


def _fresh(shape: tuple[int, ...], out_shape: tuple[int, ...], dtype: torch.dtype) -> Callable:
    """Inputs made by an op (as a layer's input is) and the output's gradient, new for every run."""
    def prepare():
        x = torch.randn(shape).to(dtype).requires_grad_()
        return x, torch.randn(out_shape).to(dtype)
    return prepare


def _unfused_swiglu(y: torch.Tensor) -> torch.Tensor:
    """megatron-core's MLP without bias_activation_fusion: F.silu of one half times the other."""
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _step(fn: Callable, params: tuple[torch.Tensor, ...]) -> Callable:
    def run(inputs) -> None:
        x, grad = inputs
        torch.autograd.grad(fn(x), (x, *params), grad)
    return run


def _differences(fns: dict[str, Callable], params: tuple[torch.Tensor, ...],
                 prepare: Callable) -> dict[str, float]:
    """Each variant's largest |difference| of output and input gradient from the first variant's, on one
    input, relative to the first's largest value."""
    x, grad = prepare()
    first, diffs = None, {}
    for name, fn in fns.items():
        out = fn(x)
        values = (out.detach().float(), torch.autograd.grad(out, (x, *params), grad)[0].float())
        first = first or values
        diffs[name] = max(((v - f).abs().max() / f.abs().max()).item() for v, f in zip(values, first))
    return diffs


def _compare(fns: dict[str, Callable], params: tuple[torch.Tensor, ...], prepare: Callable,
             reps: int) -> dict:
    diff = _differences(fns, params, prepare)
    timings = run_interleaved({name: _step(fn, params) for name, fn in fns.items()}, reps, prepare)
    return {"timings": timings, "diff": diff}


def _worker(args) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mcore = None if args.without_megatron_core else _megatron_core()
    s, b = args.seq, args.batch
    rows = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)

        norm = _rms_norm_module(mcore, args.hidden, dtype)
        shape = (s, b, args.hidden)
        fns = {"megatron_ext fused_rms_norm": lambda x: fused_rms_norm(x, norm.weight, EPS),
               "torch.nn.RMSNorm": norm}
        rows[f"rms_norm {dtype_name} {list(shape)}"] = _compare(
            fns, (norm.weight,), _fresh(shape, shape, dtype), args.reps)

        shape = (s, b, args.heads, args.head_dim)
        for interleaved in (False, True):
            freqs = _freqs(s, args.head_dim, interleaved)
            fns = {"megatron_ext fused_apply_rotary_pos_emb":
                   lambda t, i=interleaved, f=freqs: fused_apply_rotary_pos_emb(t, f, i)}
            if mcore is not None:
                fns["megatron-core _apply_rotary_pos_emb_bshd"] = (
                    lambda t, i=interleaved, f=freqs: mcore.rope(t, f, rotary_interleaved=i))
            label = "rope interleaved" if interleaved else "rope"
            rows[f"{label} {dtype_name} {list(shape)}"] = _compare(
                fns, (), _fresh(shape, shape, dtype), args.reps)

        shape, out_shape = (args.tokens, 2 * args.ffn), (args.tokens, args.ffn)
        fns = {"megatron_ext swiglu": swiglu}
        if mcore is not None:
            fns["megatron-core bias_swiglu_impl"] = lambda y: mcore.bias_swiglu_impl(y, None)
        fns["unfused F.silu(gate) * up"] = _unfused_swiglu
        rows[f"swiglu {dtype_name} {list(shape)}"] = _compare(
            fns, (), _fresh(shape, out_shape, dtype), args.reps)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float64"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--without-megatron-core", action="store_true",
                   help="megatron_ext's and torch's variants only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    require_megatron_core(args.without_megatron_core)
    (rows,) = run_distributed(1, _worker, args, timeout=3600)
    summary = {}
    for op, row in rows.items():
        summary[op] = {"results": summarize([row["timings"]]), "relative_diff_vs_first": row["diff"]}
        names = list(summary[op]["results"])
        print_table(f"{op} fwd+bwd, one CPU thread", summary[op]["results"], baseline=names[-1], unit="ms")
        print("max relative difference vs " + names[0] + ": "
              + ", ".join(f"{k} {v:.1e}" for k, v in row["diff"].items()))
        print()
    write_json("llama_kernels", {"args": vars(args), "summary": summary}, args.json)


if __name__ == "__main__":
    main()
