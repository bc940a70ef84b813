"""The step report rank 0 prints once before the first step: the parallel layout, the parameters (the
model's, each counted once, and each rank's), the training state each rank holds, and the tokens of a
step. Every rank calls ``step_report`` (it all-gathers one row of counts per rank over the world).

Parameters counted once: a parameter is counted on the ranks that hold its main copy, as the gradient
norm counts it (``MegatronOptimizer.get_main_grads_for_grad_norm``): not the last pipeline stage's copy
of the tied word embedding (``shared``), a parameter replicated over the tensor-parallel group
(``tensor_model_parallel`` unset: LayerNorm weights, the router, a row-parallel bias) on that group's
rank 0 only (the expert-tensor-parallel group for expert parameters), and of the data-parallel
replicas only the one on data-parallel rank 0 (with the context-parallel ranks; expert parameters,
``allreduce=False``: the expert-data-parallel group).

State bytes per rank are measured where the memory exists when the report is made, each storage
counted once: the model parameters' storages (under the distributed optimizer, the flat parameter
buffers they are views of, padding included), the gradient buffers (``grad_data`` of every
``DistributedDataParallel`` buffer, padding included, and any ``.grad`` or ``main_grad`` outside
them), the optimizer's main parameters that are not the model's own storage (the float32 copies of
16-bit parameters: whole, or this rank's slice of each bucket under the distributed optimizer).
The optimizer's moments are measured where they exist (after a step, or a checkpoint loaded into
the optimizer); torch allocates them at the first step, so before it they are what it will allocate:
Adam's two tensors shaped like each main parameter (``exp_avg``, ``exp_avg_sq``), SGD's momentum
buffer when the momentum is not zero. Adam's scalar ``step`` is not counted. So with Adam, per
parameter: float32 parameters 4 + 4 + 8 bytes (the distributed optimizer: 4 + 4 + 8 / dp); 16-bit
parameters with float32 gradient buffers 2 + 4 + 4 + 8 (distributed: 2 + 4 + 12 / dp), where dp is the
expert-data-parallel size for expert parameters.

Under ``FullyShardedDataParallel`` the state is what a rank holds between steps: with
``optim_grads_params`` the parameter shards (``bucket.param_shard``, this rank's slice of every
bucket) instead of the parameters, whose gathered buffers exist only around a unit's forward and
backward; with ``optim_grads`` and ``optim_grads_params`` the gradient shards (``bucket.grad_shard``)
instead of the full gradient buffers, which exist only during a unit's backward. A float32 or float64
parameter's main copy is a view of its shard and not counted again; a 16-bit parameter's is its
float32 copy. So with Adam, 16-bit parameters and float32 gradients: ``optim`` 2 + 4 + 12 / dp,
``optim_grads`` 2 + 16 / dp, ``optim_grads_params`` 18 / dp bytes per parameter. What a step holds on
top, the line "gathered in flight", is bounded from the units' buffers (``_in_flight_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext._torch_compat import all_gather_single
from megatron_ext.comm_errors import reported
from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.distributed.fully_sharded_data_parallel import FullyShardedDataParallel
from megatron_ext.resolve import find_wrapper
from megatron_ext.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron_ext.tensor_parallel.utils import comm_device

@dataclass(frozen=True)
class RankState:
    """One rank's parameters (elements, replicas included) and the bytes of its training state."""

    parameters: int
    parameter_bytes: int
    gradient_bytes: int
    main_bytes: int
    moment_bytes: int
    moments_measured: bool  # False: the moments are what the optimizer's first step will allocate
    in_flight_bytes: int = 0  # FSDP: the most a step gathers or holds full beyond the state

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.main_bytes + self.moment_bytes


@dataclass(frozen=True)
class StepReport:
    layout: dict[str, int | None]
    model_parameters: int  # each parameter once
    ranks: list[RankState]  # by global rank
    global_batch_size: int
    seq_length: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length

    def __str__(self) -> str:
        layout = ", ".join(f"{k} {'none' if v is None else v}" for k, v in self.layout.items())
        params = [r.parameters for r in self.ranks]
        totals = [r.state_bytes for r in self.ranks]
        largest = max(range(len(self.ranks)), key=lambda r: totals[r])
        big = self.ranks[largest]
        moments = "" if big.moments_measured else " (to be allocated by the optimizer's first step)"
        return "\n".join([
            f"step report (world {len(self.ranks)}): {layout}",
            f"parameters: {self.model_parameters:,} in the model (each counted once); "
            f"per rank {min(params):,} to {max(params):,}",
            f"state per rank (parameters + gradient buffers + main parameters + optimizer moments): "
            f"{_bytes(min(totals))} to {_bytes(max(totals))}",
            f"  rank {largest}: parameters {_bytes(big.parameter_bytes)}, gradient buffers "
            f"{_bytes(big.gradient_bytes)}, main parameters {_bytes(big.main_bytes)}, "
            f"optimizer moments {_bytes(big.moment_bytes)}{moments}",
            *([f"gathered in flight: up to {_bytes(in_flight)} (parameters gathered and full gradient "
               "buffers of FSDP's units during a step, on top of the state)"]
              if (in_flight := max(r.in_flight_bytes for r in self.ranks)) else []),
            f"tokens per step: {self.global_batch_size} x {self.seq_length} = {self.tokens_per_step:,}",
        ])


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def _new_storage_bytes(tensors: list[torch.Tensor], seen: set[tuple[Any, int]]) -> int:
    """The bytes of the storages of ``tensors`` not in ``seen`` (which they join)."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _counted_once(param: torch.nn.Parameter) -> bool:
    """Whether this rank holds ``param``'s counted copy (see the module's docstring)."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "allreduce", True):
        return (param_is_not_tensor_parallel_duplicate(param)
                and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
    return (param_is_not_tensor_parallel_duplicate(param, parallel_state.get_expert_tensor_parallel_group())
            and parallel_state.get_expert_data_parallel_rank() == 0)


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    inner = getattr(optimizer, "chained_optimizers", None)
    return [o.optimizer for o in inner] if inner is not None else [optimizer.optimizer]


def _moments_per_element(torch_optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """How many tensors shaped like a main parameter the first step gives it."""
    if isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
        return 3 if group.get("amsgrad") else 2
    if isinstance(torch_optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    raise ValueError(f"step_report: the optimizer state of {type(torch_optimizer).__name__} is not known; "
                     "expected torch.optim.Adam, AdamW or SGD")


def _sharded(ddp: Any, what: str) -> bool:
    """Whether ``ddp`` is a ``FullyShardedDataParallel`` whose ``what`` ("params" or "grads") exist
    only as shards between steps."""
    strategies = {"params": ("optim_grads_params",), "grads": ("optim_grads", "optim_grads_params")}
    return isinstance(ddp, FullyShardedDataParallel) and ddp.sharding_strategy in strategies[what]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _in_flight_bytes(fsdps: list[FullyShardedDataParallel]) -> int:
    """The most bytes the FSDP chunks of a rank hold during a step on top of their shards. Each
    chunk's root keeps its parameters gathered from the forward to the optimizer step and its full
    gradient buffer through the backward; of the units, three are gathered at once (the one
    computing, the next one's prefetch and the last, kept from its forward for its backward; with
    ``reshard_after_forward=False`` every unit stays gathered) and one unit's full gradient buffer
    exists at a time. One chunk computes at a time, so its units' part is counted for the largest
    chunk only. An upper bound: the three largest units need not be those."""
    held, transient = 0, [0]
    for fsdp in fsdps:
        if not _sharded(fsdp, "grads"):
            continue
        units = [u for u in fsdp._units if u.module is not None]
        root = [b for u in fsdp._units if u.module is None for b in u.buffers]
        grads = max((_nbytes(b.grad_data for b in u.buffers) for u in units), default=0)
        held += _nbytes(b.grad_data for b in root)
        params: list[int] = []
        if _sharded(fsdp, "params"):
            params = sorted((_nbytes(b.param_data for b in u.buffers) for u in units), reverse=True)
            held += _nbytes(b.param_data for b in root)
            if not fsdp.reshard_after_forward:
                held, params = held + sum(params), []
        transient.append(sum(params[:3]) + grads)
    return held + max(transient)


def _rank_row(model_chunks: list[torch.nn.Module], optimizer: Any) -> list[int]:
    params = list({id(p): p for chunk in model_chunks for p in chunk.parameters()}.values())
    ddps = [d for chunk in model_chunks if (d := find_wrapper(chunk, DistributedDataParallel)) is not None]
    buckets = {what: [b for d in ddps if _sharded(d, what) for buffer in d.buffers for b in buffer.buckets]
               for what in ("params", "grads")}
    # A fully sharded parameter is resident as its shard; its gathered buffer is counted in flight.
    shards = {p for b in buckets["params"] for p in b.params_list}
    seen: set[tuple[Any, int]] = set()
    parameter_bytes = _new_storage_bytes(
        [p for p in params if p not in shards] + [b.param_shard for b in buckets["params"]], seen)
    grads = [b.grad_shard for b in buckets["grads"]]
    grads += [buffer.grad_data for ddp in ddps if not _sharded(ddp, "grads") for buffer in ddp.buffers]
    grads += [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    gradient_bytes = _new_storage_bytes(grads, seen)
    mains = optimizer.get_parameters() if optimizer is not None else []
    main_bytes = _new_storage_bytes(mains, seen)
    moment_bytes, measured = 0, bool(mains)
    for torch_optimizer in _torch_optimizers(optimizer) if optimizer is not None else []:
        for group in torch_optimizer.param_groups:
            for main in group["params"]:
                state = torch_optimizer.state.get(main)
                if state:
                    tensors = [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
                    moment_bytes += _new_storage_bytes(tensors, seen)
                else:
                    measured = False
                    moment_bytes += (_moments_per_element(torch_optimizer, group)
                                     * main.numel() * main.element_size())
    return [sum(p.numel() for p in params), sum(p.numel() for p in params if _counted_once(p)),
            parameter_bytes, gradient_bytes, main_bytes, moment_bytes, int(measured),
            _in_flight_bytes([d for d in ddps if isinstance(d, FullyShardedDataParallel)])]


def collect_step_report(
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    *,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    etp: int | None,
    dp: int,
    vpp: int | None,
    global_batch_size: int,
    seq_length: int,
) -> StepReport:
    """The report's numbers on every rank. ``model_chunks``: this rank's model chunks (wrapped in
    ``DistributedDataParallel`` or not); ``optimizer``: the ``MegatronOptimizer`` over them (None: no
    main parameters nor moments); the layout as the run was set up (tp x cp x pp x dp must be the
    world size). Every rank must call it: it all-gathers over the world."""
    world = dist.get_world_size()
    if tp * cp * pp * dp != world:
        raise ValueError(f"step_report: tp {tp} x cp {cp} x pp {pp} x dp {dp} = {tp * cp * pp * dp}; "
                         f"expected the world size {world}")
    row = torch.tensor(_rank_row(model_chunks, optimizer), dtype=torch.int64)
    device = comm_device(dist.group.WORLD)
    gathered = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
    with reported("all-gather of the step report's counts", None, tensor=row):
        all_gather_single(gathered, row.to(device))
    rows = gathered.view(world, -1).tolist()
    ranks = [RankState(parameters=r[0], parameter_bytes=r[2], gradient_bytes=r[3], main_bytes=r[4],
                       moment_bytes=r[5], moments_measured=bool(r[6]),
                       in_flight_bytes=r[7]) for r in rows]
    return StepReport(
        layout={"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "dp": dp, "vpp": vpp},
        model_parameters=sum(r[1] for r in rows),
        ranks=ranks,
        global_batch_size=global_batch_size,
        seq_length=seq_length,
    )


def step_report(model_chunks: list[torch.nn.Module], optimizer: Any, **layout_and_batch: Any) -> str:
    """``collect_step_report``'s report (same arguments) as the text rank 0 prints, returned on every
    rank."""
    return str(collect_step_report(model_chunks, optimizer, **layout_and_batch))

