"""Sliding-window and packed-sequence attention forward + backward on the CPU (float32, batch 1, one
process with one thread): megatron_ext's attention op, whose windowed work grows as s * w, against
the same op without the window (full causal attention), torch's scaled_dot_product_attention with
an explicit band mask (the [s, s] way; its mask is made in the step, as training makes it per
shape) and, where megatron-core is installed, megatron-core 0.16.1's own DotProductAttention with
``window_size`` (its unfused attention: [s, s] scores and masks). Then a row of packed sequences:
the op with ``cu_seqlens`` against the padded batch (every sequence padded to the longest, SDPA
causal) and SDPA over the row with a block-diagonal causal mask. Timing and memory method:
benchmarks/common.py; the full, masked and megatron-core variants stop at ``--full-max-seq`` and
``--megatron-core-max-seq`` (quadratic time and memory).

    ./dev.sh bench attention_windows [--seq 1024 ... 32768] [--window 512] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from common import import_megatron_core, require_megatron_core, run_interleaved, summarize, write_json

import megatron_ext  # noqa: F401  (registers the ops)
from tests.distributed import run_distributed


def _op(q, k, v, window=None, cu_seqlens=None):
    op = torch.ops.megatron_ext.context_parallel_attention
    return op(q, k, v, "", 1, 0, True, "p2p", None, window, None, cu_seqlens)


def _band(s: int, window: int) -> torch.Tensor:
    """SDPA's boolean mask: True where query i sees key j (i - window < j <= i)."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return (j <= i) & (i - j < window)


def _megatron_core(heads: int, head_dim: int, window: int):
    """megatron-core's DotProductAttention with ``window_size=(window - 1, 0)`` (tp 1, its
    parallel_state initialised); the CUDA calls it makes are sent to the CPU: its scores buffer's
    device, the dropout's RNG fork (dropout 0), and its window mask, made as it makes it."""
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state as mps
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig as McoreConfig

    def window_mask(sq, skv, window_size):  # megatron-core's, on the CPU
        m = torch.ones(sq, skv, dtype=torch.bool)
        upper = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = window_mask
    mps.initialize_model_parallel()
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    config = McoreConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                         attention_dropout=0.0, use_cpu_initialization=True, window_size=(window - 1, 0))
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self")


def _packed_lengths(total: int, count: int, seed: int) -> list[int]:
    """``count`` sequence lengths between half and 1.5 times the mean, summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    weights = 0.5 + torch.rand(count, generator=g)
    lengths = (weights / weights.sum() * total).long().clamp(min=1)
    lengths[-1] += total - int(lengths.sum())
    return lengths.tolist()


def _fwd_bwd(fn, shapes):
    """A step: fresh inputs (as a projection would produce them), forward, backward."""
    def step():
        leaves = [torch.randn(*shape).requires_grad_() for shape in shapes]
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return step


def _worker(args) -> dict:
    torch.set_num_threads(1)
    mcore = None
    if not args.without_megatron_core and import_megatron_core() is not None:
        mcore = _megatron_core(args.heads, args.head_dim, args.window)
    h, d, w = args.heads, args.head_dim, args.window
    windows, packed = {}, {}
    for s in args.seq:
        shape = (1, h, s, d)
        variants = {f"window {w} (megatron_ext)": _fwd_bwd(lambda q, k, v: _op(q, k, v, w), [shape] * 3)}
        if s <= args.full_max_seq:
            variants["full causal (megatron_ext)"] = _fwd_bwd(lambda q, k, v: _op(q, k, v), [shape] * 3)
            variants["sdpa band mask"] = _fwd_bwd(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2], w)),
                [shape] * 3,
            )
        if mcore is not None and s <= args.megatron_core_max_seq:
            # megatron-core takes [s, b, n, d]
            variants["megatron-core window"] = _fwd_bwd(
                lambda q, k, v: mcore(q, k, v, attention_mask=None), [(s, 1, h, d)] * 3
            )
        windows[str(s)] = run_interleaved(variants, args.reps)
    for s in args.packed_seq:
        lengths = _packed_lengths(s, args.sequences, seed=s)
        bounds = torch.tensor([0] + lengths).cumsum(0)
        longest = max(lengths)
        segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

        def block_diagonal(q, k, v):
            i = torch.arange(q.shape[2])
            mask = (segment[:, None] == segment[None, :]) & (i[None, :] <= i[:, None])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        variants = {
            "packed (megatron_ext cu_seqlens)": _fwd_bwd(
                lambda q, k, v: _op(q, k, v, None, bounds), [(1, h, s, d)] * 3
            ),
            "padded batch (sdpa causal)": _fwd_bwd(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                [(len(lengths), h, longest, d)] * 3,
            ),
        }
        if s <= args.full_max_seq:
            variants["block-diagonal mask (sdpa)"] = _fwd_bwd(block_diagonal, [(1, h, s, d)] * 3)
        packed[str(s)] = {"lengths": lengths, "runs": run_interleaved(variants, args.reps)}
    return {"windows": windows, "packed": packed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--window", type=int, default=512, help="keys a query sees, itself included")
    p.add_argument("--full-max-seq", type=int, default=8192,
                   help="longest sequence for the full and masked attention (quadratic)")
    p.add_argument("--megatron-core-max-seq", type=int, default=4096,
                   help="longest sequence for megatron-core's unfused attention ([s, s] scores)")
    p.add_argument("--packed-seq", type=int, nargs="+", default=[4096, 8192],
                   help="lengths of the packed rows")
    p.add_argument("--sequences", type=int, default=8, help="sequences per packed row")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--without-megatron-core", action="store_true", help="no megatron-core variant")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    require_megatron_core(args.without_megatron_core)
    (result,) = run_distributed(1, _worker, args, timeout=7200)
    windows = {s: summarize([r]) for s, r in result["windows"].items()}
    packed = {
        s: {"lengths": r["lengths"], "summary": summarize([r["runs"]])} for s, r in result["packed"].items()
    }
    print(f"attention fwd+bwd, float32, b 1, {args.heads} heads x {args.head_dim}, one CPU thread")
    print(f"{'seq':>6} {'variant':<36} {'median s':>9} {'min':>8} {'max':>8} {'peak extra MiB':>15}")
    rows = [(s, rows) for s, rows in windows.items()] + [(s, r["summary"]) for s, r in packed.items()]
    for s, summary in rows:
        for name, r in summary.items():
            print(f"{s:>6} {name:<36} {r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['max_s']:>8.3f} "
                  f"{r['peak_extra_mib']:>15.1f}")
    write_json("attention_windows", {"args": vars(args), "windows": windows, "packed": packed}, args.json)


if __name__ == "__main__":
    main()
