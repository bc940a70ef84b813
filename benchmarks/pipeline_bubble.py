"""The pipeline bubble, measured and simulated: 1F1B, ZB-H1 and ZB-V on 4 CPU ranks (gloo, one
thread each), and megatron-core 0.16.1's own 1F1B on the same model as the peer.

The model's costs are set, not measured: each layer's forward sleeps ``F`` ms, the input half of
its backward ``I`` ms and the weight half ``W`` ms (a layer is ``sleep_f_i(x) + sleep_w(w)``,
so the autograd engine runs the two halves separately). Sleeping ranks leave the cores free, so
four ranks behave as four devices on this two-core machine; what the wall clock adds to the
simulated step is the runner's own time and gloo's transfers. Each rank holds ``--layers``
layers (ZB-V: two chunks of half as many). Timing method: benchmarks/common.py (one step per
repetition, slowest rank).

    ./dev.sh bench pipeline_bubble [--microbatches 8] [--f 10 --i 10 --w 10] [--reps 5]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from common import import_megatron_core, require_megatron_core, run_interleaved, summarize, write_json

from megatron_ext import parallel_state as ps
from megatron_ext.pipeline_parallel import get_forward_backward_func
from megatron_ext.pipeline_parallel import schedules as sch
from megatron_ext.pipeline_parallel.schedule_simulator import simulate_schedule
from megatron_ext.pipeline_parallel.schedule_tables import virtual_stage
from tests.distributed import run_distributed

PP = 4
SHAPE = (32, 2, 64)  # [s, b, h] sent between stages


class _SleepForwardInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f_s, i_s):
        ctx.i_s = i_s
        time.sleep(f_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.i_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, w_s):
        ctx.w_s = w_s
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.w_s)
        return grad, None


class TimedStage(torch.nn.Module):
    """``layers`` layers of ``x + w`` that sleep F in forward, I and W in the backward halves."""

    def __init__(self, layers: int, costs_s: tuple[float, float, float], first: bool, config) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(SHAPE[-1])) for _ in range(layers))
        self.costs_s, self.first, self.config = costs_s, first, config
        self.input_tensor = None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.first else self.input_tensor
        f_s, i_s, w_s = self.costs_s
        for w in self.weights:
            h = _SleepForwardInput.apply(h, f_s, i_s) + _SleepWeight.apply(w, w_s)
        return h


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)
    return out, lambda output: (output.square().mean(), {"loss": output.detach().mean()})


def _chunks(schedule: str, layers: int, costs_s, config) -> list[TimedStage]:
    rank = ps.get_pipeline_model_parallel_rank()
    if schedule == "zb-v":
        return [TimedStage(layers // 2, costs_s, virtual_stage(rank, c, PP, "v") == 0, config)
                for c in (0, 1)]
    return [TimedStage(layers, costs_s, rank == 0, config)]


def _worker(args) -> dict:
    costs_s = (args.f / 1e3, args.i / 1e3, args.w / 1e3)
    torch.set_num_threads(1)
    ps.initialize_model_parallel(pipeline_model_parallel_size=PP)
    config = SimpleNamespace(hidden_size=SHAPE[-1], pipeline_dtype=torch.float32, variable_seq_lengths=False,
                             batch_p2p_comm=True, deallocate_pipeline_outputs=False, sequence_parallel=False)
    batches = [torch.randn(SHAPE) for _ in range(args.microbatches)]
    models = {s: _chunks(s, args.layers, costs_s, config) for s in ("1f1b", "zb-h1", "zb-v")}

    def ours(schedule: str):
        chunks = models[schedule]

        def step():
            get_forward_backward_func(schedule=schedule)(
                forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks],
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=args.microbatches,
                seq_length=SHAPE[0], micro_batch_size=SHAPE[1])
        return step

    variants = {f"megatron_ext {s}": ours(s) for s in models}
    if not args.without_megatron_core and import_megatron_core() is not None:
        variants["megatron-core 1f1b"] = _megatron_core_1f1b(args, costs_s, batches)
    times = run_interleaved(variants, args.reps)
    ps.destroy_model_parallel()
    return times


def _megatron_core_1f1b(args, costs_s, batches):
    """megatron-core's forward_backward_pipelining_without_interleaving over its own
    parallel_state (the same 4 ranks as one pipeline), on the same timed model."""
    # The three CUDA calls megatron-core's 1F1B makes on this CPU machine, sent to the CPU: its
    # receive buffers on torch.cuda.current_device(), its token counter (torch.zeros(device="cuda"))
    # and torch.cuda.synchronize() after each exchange (a no-op here).
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    zeros = torch.zeros

    def zeros_on_cpu(*size, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return zeros(*size, **kwargs)

    torch.zeros = zeros_on_cpu
    from megatron.core import parallel_state as mps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    mps.initialize_model_parallel(pipeline_model_parallel_size=PP)
    config = ModelParallelConfig(pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32)
    config.hidden_size = SHAPE[-1]
    config.fine_grained_activation_offloading = False  # a TransformerConfig field its 1F1B reads
    model = TimedStage(args.layers, costs_s, mps.is_pipeline_first_stage(), config)
    model.model_type = ModelType.encoder_or_decoder

    def step():
        forward_backward_pipelining_without_interleaving(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=args.microbatches, seq_length=SHAPE[0], micro_batch_size=SHAPE[1])
    return step


def simulated(args) -> dict[str, float]:
    """The simulator's step time (ms) for each schedule at the same per-action costs."""
    m, layers = args.microbatches, args.layers
    stage = dict(F=args.f * layers, I=args.i * layers, W=args.w * layers)
    chunk = {k: v / 2 for k, v in stage.items()}
    one_f_one_b = simulate_schedule([sch.one_f_one_b_table(m, PP, r) for r in range(PP)], stage).makespan
    return {
        "megatron_ext 1f1b": one_f_one_b,
        "megatron_ext zb-h1": simulate_schedule(
            [sch.zero_bubble_h1_table(m, PP, r) for r in range(PP)], stage).makespan,
        "megatron_ext zb-v": simulate_schedule(
            [sch.zbv_table(m, PP, r) for r in range(PP)], chunk, 2, "v").makespan,
        "megatron-core 1f1b": one_f_one_b,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=2, help="layers per rank (ZB-V: two chunks of half)")
    p.add_argument("--f", type=float, default=10.0, help="forward ms per layer")
    p.add_argument("--i", type=float, default=10.0, help="input-gradient ms per layer")
    p.add_argument("--w", type=float, default=10.0, help="weight-gradient ms per layer")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--without-megatron-core", action="store_true", help="run megatron_ext's schedules only")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.layers % 2:
        p.error("--layers must be even (ZB-V splits them into two chunks)")
    require_megatron_core(args.without_megatron_core)
    summary = summarize(run_distributed(PP, _worker, args, timeout=1800))
    sim = simulated(args)
    ideal = args.microbatches * args.layers * (args.f + args.i + args.w)
    print(f"pipeline step, pp {PP}, m {args.microbatches}, per layer F {args.f} I {args.i} W {args.w} ms, "
          f"{args.layers} layers per rank; ideal (no bubble) {ideal:.0f} ms")
    print(f"{'variant':<22} {'min':>8} {'median':>8} {'max':>8} {'simulated':>10} {'bubble':>8} "
          f"{'sim bubble':>10}   (ms; bubble = median / ideal - 1)")
    for name, s in summary.items():
        med = s["median_s"] * 1e3
        bubbles = f"{med / ideal - 1:>8.3f} {sim[name] / ideal - 1:>10.3f}" if ideal > 0 else ""
        print(f"{name:<22} {s['min_s'] * 1e3:>8.1f} {med:>8.1f} {s['max_s'] * 1e3:>8.1f} {sim[name]:>10.1f} "
              + bubbles)
    write_json("pipeline_bubble", {"args": vars(args), "ideal_ms": ideal, "simulated_ms": sim,
                                   "summary": summary}, args.json)


if __name__ == "__main__":
    main()
