"""Fully sharded data parallelism (Megatron-core's ``FullyShardedDataParallel``): the distributed
optimizer's flat buffers and shards, taken one step further.

The model is cut into *units*: each module of ``fsdp_unit_modules`` (default: every transformer
layer, multi-token-prediction layer included; a unit inside a unit belongs to the outer one) and
the *root*, every parameter outside them (embeddings, final norm, output layer). Each unit's
parameters of one (dtype, gradient dtype, dense or expert) kind live in a ``_ParamAndGradBuffer``
laid out as the distributed optimizer's (parameters at multiples of 64 elements, a bucket padded
to a multiple of lcm(dp, 128), a shared embedding in a bucket of its own), and data-parallel rank r
owns the r-th of dp equal slices of every bucket: its *shards* (``param_shard``, ``grad_shard``).
Dense buckets are sharded over the data × context-parallel group, expert buckets over the expert
data-parallel group; each tensor-parallel rank shards its own slice of the model.

``data_parallel_sharding_strategy``:

* ``"no_shard"``: ``DistributedDataParallel``'s all-reduce (every rank keeps everything);
* ``"optim"``: the distributed optimizer (gradients reduce-scattered, the optimizer state sharded);
* ``"optim_grads"``: gradients sharded too: a unit's gradients land in a full buffer that exists
  only during its backward; once every parameter of the unit has its gradient (in the order units
  finish, the same on every rank) the buffer is reduce-scattered, this rank's slice added into
  ``grad_shard`` and the buffer freed. Every micro-batch's backward reduces, as in Megatron-FSDP
  (``no_sync`` does not hold full gradients back), so each micro-batch's gradient is added once;
* ``"optim_grads_params"``: parameters sharded too: a unit's parameters are all-gathered from the
  shards just before its forward (the next unit's gather started while this one computes), freed
  after it, gathered again just before its backward (a hook on the unit's outputs) and freed once
  its gradients are reduced. The root's parameters are gathered at the wrapper's forward and freed
  after the optimizer step.

``param.main_grad`` is, between backwards, the part of the parameter's gradient this rank owns (a
1-D view of ``grad_shard``, empty where the rank owns none of it), so ``finalize_model_grads``'
reductions over the tensor-parallel and embedding groups work on the shards: their members lay
their buffers out alike. The optimizer (``get_megatron_optimizer`` with
``use_distributed_optimizer``) updates the shards; its grad norm and clipping reduce over the
data-parallel and model-parallel groups, so they are the whole model's.

A gathered buffer keeps its tensor (the parameters are views of it) and loses only its storage
(``untyped_storage().resize_(0)``), so the tensors autograd saved in the forward read the values
gathered again before the backward. On a GPU the gathers are asynchronous collectives of the
current stream; on CPUs with gloo the same code runs, gloo completing them on its own threads.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import ReportedWork, reported
from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.distributed.distributed_data_parallel_config import as_ddp_config
from megatron_ext.distributed.fsdp_units import (
    Unit,
    allocate,
    backward_order,
    class_names,
    find_units,
    free,
    is_allocated,
    output_tensors,
    unit_classes,
)
from megatron_ext.distributed.param_and_grad_buffer import (
    _ParamAndGradBucket,
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    dist_all_gather_func,
    dist_reduce_scatter_func,
    partition_buckets,
    shard_buffer,
)
from megatron_ext.tensor_parallel.meta_init import has_meta_tensors, materialize
from megatron_ext.distributed.reduce_scatter_with_fp32_accumulation import (
    reduce_scatter_with_fp32_accumulation,
)

class FullyShardedDataParallel(DistributedDataParallel):
    """Megatron-core's ``FullyShardedDataParallel(config, ddp_config, module, fsdp_unit_modules=None,
    disable_bucketing=False, device=None, pg_collection=None)``: the strategies and the life of a
    unit are in the module docstring.

    ``fsdp_unit_modules``: module classes (or their names) whose instances are units; None gives
    the transformer layers; ``disable_bucketing`` makes the whole model one unit (the root), as it
    makes it one bucket for ``DistributedDataParallel``. ``device`` must be the parameters' device
    when given.
    ``reshard_after_forward`` (keyword only; not in Megatron-core): False keeps a unit's gathered
    parameters from its first forward of a step to the optimizer step, one gather per step instead
    of two per micro-batch, at the memory of the whole model; ``no_sync`` then defers the
    gradient reduction to the next backward outside it (once per step in the schedules). With
    resharding (the default) gradients are reduced in every backward, ``no_sync`` or not, as
    Megatron-FSDP does: their full copies are freed.
    """

    _is_fsdp = True

    def __init__(
        self,
        config: Any,
        ddp_config: Any,
        module: torch.nn.Module,
        fsdp_unit_modules: list[type | str] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | str | None = None,
        pg_collection: Any = None,
        *,
        reshard_after_forward: bool = True,
    ) -> None:
        ddp_config = as_ddp_config(ddp_config)
        strategy = ddp_config.data_parallel_sharding_strategy
        self._check_options(config, ddp_config, module, device)
        self.sharding_strategy = strategy
        self._shard_grads = strategy in ("optim_grads", "optim_grads_params")
        self._shard_params = strategy == "optim_grads_params"
        self.reshard_after_forward = bool(reshard_after_forward)
        # The buffers are the distributed optimizer's from "optim" on.
        effective = as_ddp_config(
            ddp_config,
            use_distributed_optimizer=strategy != "no_shard" or ddp_config.use_distributed_optimizer,
            overlap_param_gather=ddp_config.overlap_param_gather and not self._shard_params,
            overlap_grad_reduce=ddp_config.overlap_grad_reduce and not self._shard_grads,
        )
        self._unit_classes = unit_classes(fsdp_unit_modules)
        if disable_bucketing:
            if fsdp_unit_modules:
                self._refuse(
                    f"disable_bucketing=True makes the model one unit; it cannot be combined with "
                    f"fsdp_unit_modules {class_names(fsdp_unit_modules)}"
                )
            self._unit_classes = ()
        self._units: list[Unit] = []
        self._unit_of: dict[torch.nn.Parameter, Unit] = {}
        self._unit_of_module: dict[torch.nn.Module, Unit] = {}
        # A model built on the meta device is drawn here: unit by unit with sharded gradients, each
        # unit's parameters (under optim_grads_params) sharded before the next is drawn.
        self._draw_on = None
        if has_meta_tensors(module):
            self._draw_on = torch.device(device) if device is not None else (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else
                torch.device("cpu")
            )
            if not self._shard_grads:
                materialize(module, self._draw_on)
        super().__init__(config, effective, module, disable_bucketing, pg_collection)
        self.ddp_config = effective
        self.fsdp_unit_modules = list(self._unit_classes)
        if not self._shard_grads:
            return
        if not any(u.module is not None for u in self._units) and fsdp_unit_modules is not None:
            self._refuse(
                f"fsdp_unit_modules {class_names(fsdp_unit_modules)} name no module of "
                f"{type(module).__name__}"
            )
        self._check_communication_size(ddp_config.suggested_communication_unit_size)
        for unit in self._units:
            unit.gathered = not self._shard_params
        self._point_main_grads_at_shards()
        self._forward_order: list[Unit] = []
        self._deferring = False
        self._order_known = False
        self._hooks: list[Any] = []
        for unit in self._units:
            if unit.module is not None:
                self._hooks.append(unit.module.register_forward_pre_hook(self._unit_pre_forward))
                self._hooks.append(unit.module.register_forward_hook(self._unit_post_forward))

    # Construction ------------------------------------------------------------------------------

    @staticmethod
    def _refuse(message: str) -> None:
        raise ValueError(f"FullyShardedDataParallel: {message}")

    def _check_options(self, config: Any, ddp_config: Any, module: Any, device: Any) -> None:
        strategy = ddp_config.data_parallel_sharding_strategy  # checked by the config
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if has_meta_tensors(module) and strategy == "no_shard":
            self._refuse(
                "the module has parameters on the meta device (init_model_with_meta_device), which only a "
                "sharding strategy (optim, optim_grads, optim_grads_params) draws, not 'no_shard'"
            )
        if device is not None:
            wanted = torch.device(device)
            have = {p.device for p in module.parameters() if not p.is_meta}
            if any(d.type != wanted.type or (wanted.index is not None and d != wanted) for d in have):
                self._refuse(
                    f"device {str(wanted)!r}, but the module's parameters are on {sorted(map(str, have))}"
                )
        if strategy in ("optim_grads", "optim_grads_params") and getattr(
            config, "gradient_accumulation_fusion", False
        ):
            self._refuse(
                f"gradient_accumulation_fusion with data_parallel_sharding_strategy {strategy!r}: the "
                "full gradient of a unit exists only during its backward; turn the fusion off"
            )
        if ddp_config.num_distributed_optimizer_instances > 1:
            raise NotImplementedError(
                "FullyShardedDataParallel: num_distributed_optimizer_instances > 1 (hybrid sharding) is not "
                "supported by megatron_ext"
            )

    def _allocate_buffers(
        self, named: list[tuple[str, torch.nn.Parameter]], disable_bucketing: bool, expert: bool = False
    ) -> tuple[list[_ParamAndGradBuffer], list[_ParamAndGradBucketGroup]]:
        """Without sharded gradients, DistributedDataParallel's buffers; with them, one buffer per
        (unit, kind), its one bucket the unit's (the root's shared embedding in a bucket of its
        own)."""
        if not self._shard_grads:
            return super()._allocate_buffers(named, disable_bucketing, expert)
        if not self._units:
            self._units, self._unit_of, self._unit_of_module = find_units(self.module, self._unit_classes)
            self._root = self._units[-1]
        buffers: list[_ParamAndGradBuffer] = []
        by_unit: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in named:
            by_unit.setdefault(id(self._unit_of[p]), []).append((name, p))
        saved = self.bucket_size, self.bucket_size_bytes
        self.bucket_size = self.bucket_size_bytes = None
        try:
            for unit in self._units:
                members = by_unit.get(id(unit), [])
                if members:
                    if self._draw_on is not None:
                        self._draw(unit, [p for _, p in members])
                    made, _ = super()._allocate_buffers(members, True, expert)
                    for buffer in made:
                        self._shard_buffer(buffer)
                    unit.buffers.extend(made)
                    buffers.extend(made)
        finally:
            self.bucket_size, self.bucket_size_bytes = saved
        return buffers, partition_buckets(buffers)

    def _check_communication_size(self, size: int | None) -> None:
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            self._refuse(f"suggested_communication_unit_size must be None or an integer >= 1, got {size!r}")
        for unit in self._units:
            numel = sum(b.padded_numel for b in unit.buckets)
            if numel > size:
                self._refuse(
                    f"unit {unit.name!r} gathers {numel} elements at once, more than "
                    f"suggested_communication_unit_size={size}; raise it or choose smaller fsdp_unit_modules"
                )

    def _draw(self, unit: Unit, params: list[torch.nn.Parameter]) -> None:
        """Draws ``params`` of ``unit`` (on the meta device) as a model built directly has them."""
        if unit.module is not None:
            materialize(unit.module, self._draw_on, params=params)
        else:
            inner = [u.module for u in self._units if u.module is not None]
            materialize(self.module, self._draw_on, skip=tuple(inner), params=params)

    def _shard_buffer(self, buffer: _ParamAndGradBuffer) -> None:
        """Keeps this rank's slice of each bucket of ``buffer`` in shards of their own and frees the
        full gradient buffer (and the parameter buffer under ``optim_grads_params``): done as each
        unit's buffer is made, so wrapping holds one unit whole at a time."""
        group = buffer.data_parallel_group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        with torch.no_grad():
            for bucket in buffer.buckets:
                local = shard_buffer(bucket.param_data, size)[rank]
                bucket.param_shard = local.clone() if self._shard_params else local
                grads = bucket.grad_data
                bucket.grad_shard = torch.zeros(local.numel(), dtype=grads.dtype, device=grads.device)
                bucket.shard_start = rank * local.numel()
        free(buffer.grad_data)
        if self._shard_params:
            free(buffer.param_data)

    def _point_main_grads_at_shards(self) -> None:
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                lo = bucket.shard_start
                hi = lo + bucket.grad_shard.numel()
                for p in bucket.params_list:
                    start, end = bucket.param_to_index[p]
                    a, b = max(start, lo), min(end, hi)
                    p.main_grad = bucket.grad_shard[a - lo : max(a, b) - lo]

    # What the distributed optimizer reads ----------------------------------------------------

    def param_shard(self, bucket: _ParamAndGradBucket) -> torch.Tensor:
        """This rank's slice of ``bucket``'s parameters (what the optimizer updates)."""
        if not self._shard_grads:
            return super().param_shard(bucket)
        return bucket.param_shard

    def grad_shard(self, bucket: _ParamAndGradBucket) -> torch.Tensor:
        """This rank's slice of ``bucket``'s reduced gradients."""
        if not self._shard_grads:
            return super().grad_shard(bucket)
        return bucket.grad_shard

    @property
    def params_are_sharded(self) -> bool:
        """Whether a parameter's full value exists only while its unit is gathered."""
        return self._shard_params

    # Parameters --------------------------------------------------------------------------------

    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered or unit.gather_works:
            return
        for buffer in unit.buffers:
            allocate(buffer.param_data)
            group = buffer.data_parallel_group
            if dist.get_world_size(group) == 1:  # the shard is the whole buffer
                for bucket in buffer.buckets:
                    bucket.param_data.copy_(bucket.param_shard)
                continue
            for bucket in buffer.buckets:
                what = f"all-gather of the parameters of unit {unit.name!r}"
                with reported(what, group, tensor=bucket.param_shard):
                    work = dist_all_gather_func(
                        bucket.param_data, bucket.param_shard, group=group, async_op=True
                    )
                unit.gather_works.append(ReportedWork(work, what, group, tensor=bucket.param_shard))

    def _wait_gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        self._start_gather(unit)
        works, unit.gather_works = unit.gather_works, []
        for work in works:
            work.wait()
        unit.gathered = True

    def _release(self, unit: Unit) -> None:
        """Frees ``unit``'s gathered parameters (under ``optim_grads_params``)."""
        if not self._shard_params or not unit.gathered or unit.held:
            return
        for buffer in unit.buffers:
            free(buffer.param_data)
        unit.gathered = False

    def _next_in_forward(self, unit: Unit, step: int) -> Unit | None:
        order = self._forward_order
        if unit not in order:
            return None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    def _unit_pre_forward(self, module: torch.nn.Module, *unused: Any) -> None:
        unit = self._unit_of_module[module]
        if not self._in_backward() and unit not in self._forward_order:
            self._forward_order.append(unit)
        unit.held = False
        self._wait_gather(unit)
        nxt = self._next_in_forward(unit, 1)
        if nxt is not None and self._shard_params:
            self._start_gather(nxt)

    def _unit_post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        unit = self._unit_of_module[module]
        tensors = [t for t in output_tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, unit=unit: self._unit_pre_backward(unit), mode="any"
            )
        # The last unit's backward is the first to come: it stays gathered for it (once the
        # forward order is known, from the second forward on).
        last = self._order_known and unit is self._forward_order[-1] and bool(tensors)
        if self.reshard_after_forward and not self._in_backward() and not last:
            self._release(unit)
        return output

    def _unit_pre_backward(self, unit: Unit) -> None:
        self._wait_gather(unit)
        prev = self._next_in_forward(unit, -1)
        if prev is not None and self._shard_params:
            self._start_gather(prev)

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._shard_params:
            self._order_known = bool(self._forward_order)
            self._root.held = False
            self._wait_gather(self._root)
            if self._forward_order:
                self._start_gather(self._forward_order[0])
        return self.module(*args, **kwargs)

    def gather_all_params(self) -> None:
        """Gathers every unit's parameters and keeps them until the next forward of the unit or
        ``reshard_params()``: for reading or loading a state dict, or a checkpoint. Without
        sharded parameters it waits for the gathers the optimizer step left in flight."""
        if not self._shard_params:
            self.finish_param_sync()
            return
        for unit in self._units:
            self._wait_gather(unit)
            unit.held = True

    def reshard_params(self, write_back: bool = False) -> None:
        """Frees what ``gather_all_params`` kept; ``write_back`` first copies this rank's slice of
        each gathered buffer into its shard (after loading values into the parameters)."""
        if not self._shard_params:
            return
        with torch.no_grad():
            for unit in self._units:
                if write_back and unit.gathered:
                    for bucket in unit.buckets:
                        size = bucket.param_shard.numel()
                        lo = bucket.shard_start
                        bucket.param_shard.copy_(bucket.param_data[lo : lo + size])
                unit.held = False
                self._release(unit)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """After the optimizer step: under ``optim_grads_params`` the gathered copies are stale and
        freed (the next forward gathers the updated shards); otherwise the parameters are
        all-gathered as the distributed optimizer's."""
        if not self._shard_params:
            super().start_param_sync(force_sync=force_sync, force_dispatch=force_dispatch)
            return
        for unit in self._units:
            self._wait_gather(unit) if unit.gather_works else None
            unit.held = False
            self._release(unit)

    def finish_param_sync(self) -> None:
        """Waits for the parameter gathers in flight."""
        if not self._shard_params:
            super().finish_param_sync()
            return
        for unit in self._units:
            if unit.gather_works:
                self._wait_gather(unit)

    def enable_forward_pre_hook(self) -> None:
        """As ``DistributedDataParallel``'s; under ``optim_grads_params`` the units' own hooks
        always gather, and this does nothing (Megatron-LM's loop calls it around evaluations)."""
        if not self._shard_params:
            super().enable_forward_pre_hook()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        if not self._shard_params:
            super().disable_forward_pre_hook(param_sync)

    def stop_communication(self) -> None:
        """Megatron-core's: waits for every collective in flight (parameter gathers, gradient
        reductions) without ending the step; ``finish_grad_sync`` still completes the reductions."""
        for unit in self._units:
            self._finish_reductions(unit) if unit.reductions else None
        for group in [*self.bucket_groups, *self.expert_parallel_bucket_groups]:
            if group.grad_reduce_handle is not None:
                group.grad_reduce_handle.wait()
        self.finish_param_sync()

    @property
    def param_gather_in_flight(self) -> bool:
        if not self._shard_params:
            return super().param_gather_in_flight
        return any(u.gather_works for u in self._units)

    # Gradients ---------------------------------------------------------------------------------

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._shard_grads:
            super()._on_grad_ready(param)
            return
        unit = self._unit_of[param]
        if param.grad is None:
            return
        if unit.reductions:
            self._finish_reductions(unit)
        for buffer in unit.buffers:
            if allocate(buffer.grad_data):
                buffer.grad_data.zero_()
        buffer = next(b for b in unit.buffers if param in b.param_index_map)
        with torch.no_grad():
            buffer.grad_view(param).add_(param.grad)
        param.grad = None
        if self._deferring:  # inside no_sync without resharding: summed, reduced at the sync pass
            return
        unit.arrived.add(param)
        if len(unit.arrived) == len(unit.params):
            self._reduce_ready_units()

    def _reduce_ready_units(self) -> None:
        for unit in backward_order(self._units, self._forward_order):
            if not unit.arrived:
                continue
            if len(unit.arrived) < len(unit.params):
                return
            self._start_reduction(unit)

    def _start_reduction(self, unit: Unit) -> None:
        """Reduce-scatters ``unit``'s full gradient buffers (what arrived since the last
        reduction; zeros for the rest) and frees them once added into the shards."""
        config = self._buffer_config
        average = config.average_in_collective
        scatter = (
            reduce_scatter_with_fp32_accumulation if config.reduce_scatter_with_fp32_accumulation
            else dist_reduce_scatter_func
        )
        for buffer in unit.buffers:
            if not is_allocated(buffer.grad_data):
                continue
            group = buffer.data_parallel_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            for bucket in buffer.buckets:
                if config.check_for_nan_in_grad and not bool(torch.isfinite(bucket.grad_data).all()):
                    raise RuntimeError(
                        f"FullyShardedDataParallel: a gradient of unit {unit.name!r} is NaN or infinite "
                        "before its data-parallel reduction (check_for_nan_in_grad)"
                    )
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data.mul_(bucket.gradient_scaling_factor)
                local = shard_buffer(bucket.grad_data, size)[rank]
                work = None
                if size > 1:
                    what = f"reduce-scatter of the gradients of unit {unit.name!r}"
                    with reported(what, group, tensor=bucket.grad_data):
                        work = scatter(
                            local, bucket.grad_data, op=dist.ReduceOp.SUM, group=group, async_op=True
                        )
                    work = ReportedWork(work, what, group, tensor=bucket.grad_data)
                unit.reductions.append((work, local, bucket.grad_shard, size if average else 1))
        unit.arrived = set()
        self._finish_reductions(unit)

    def _finish_reductions(self, unit: Unit) -> None:
        """Waits for ``unit``'s reduce-scatters, adds their results into the shards, frees the full
        gradient buffers and, when the unit is no longer needed gathered, its parameters."""
        reductions, unit.reductions = unit.reductions, []
        for work, local, shard, divisor in reductions:
            if work is not None:
                work.wait()
            if divisor != 1:
                local.div_(divisor)
            shard.add_(local)
        for buffer in unit.buffers:
            if is_allocated(buffer.grad_data):
                free(buffer.grad_data)
        if self.reshard_after_forward and unit is not self._root:
            self._release(unit)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Under ``optim_grads`` and ``optim_grads_params`` backwards inside it still reduce (as in
        Megatron-FSDP), unless ``reshard_after_forward=False``: then the units, whole for the step
        anyway, sum their full gradients until the next backward outside it, which reduces once."""
        if not self._shard_grads:
            with super().no_sync():
                yield
            return
        previous = self._deferring
        self._deferring = not self.reshard_after_forward
        try:
            yield
        finally:
            self._deferring = previous

    def start_grad_sync(self, *unused: Any) -> None:
        if not self._shard_grads:
            super().start_grad_sync()
            return
        self._flush()

    def _flush(self) -> None:
        for unit in backward_order(self._units, self._forward_order):
            if unit.arrived or any(is_allocated(b.grad_data) for b in unit.buffers):
                self._start_reduction(unit)
            elif unit.reductions:
                self._finish_reductions(unit)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Reduces what has not been (a unit some of whose parameters got no gradient: zeros for
        them), in the units' order, and waits for every reduction."""
        if not self._shard_grads:
            super().finish_grad_sync(force_all_reduce)
            return
        if force_all_reduce:
            raise NotImplementedError(
                "FullyShardedDataParallel: force_all_reduce with sharded gradients (there is no full "
                "gradient to all-reduce)"
            )
        self._flush()

    def zero_grad_buffer(self) -> None:
        if not self._shard_grads:
            super().zero_grad_buffer()
            return
        for unit in self._units:
            self._finish_reductions(unit) if unit.reductions else None
            unit.arrived = set()
            for buffer in unit.buffers:
                if is_allocated(buffer.grad_data):
                    free(buffer.grad_data)
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                bucket.grad_shard.zero_()
        for p in self.params_with_grad:
            p.grad = None
            p.grad_added_to_main_grad = False

    def scale_gradients(self, scaling_factor: float) -> None:
        if not self._shard_grads:
            super().scale_gradients(scaling_factor)
            return
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                bucket.grad_shard.mul_(scaling_factor)

    def broadcast_params(self) -> None:
        if not self._shard_params:
            super().broadcast_params()
            return
        self.gather_all_params()
        for buffer in self.buffers:
            group = buffer.data_parallel_group
            dist.broadcast(buffer.param_data, src=dist.get_global_rank(group, 0), group=group)
        self.reshard_params(write_back=True)

    # State dicts: the whole parameters, gathered --------------------------------------------

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        self.gather_all_params()
        out = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if not keep_vars:
            out = type(out)((k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items())
            self.reshard_params()
        return out

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> Any:
        self.gather_all_params()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.reshard_params(write_back=True)
        return result

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """As ``DistributedDataParallel``'s, over the gathered parameters (kept gathered until the
        next forward or ``reshard_params()``)."""
        self.gather_all_params()
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        units = sum(u.module is not None for u in self._units) if self._units else 0
        return f"data_parallel_size={self._dp_size}, strategy={self.sharding_strategy}, units={units}"


__all__ = ["FullyShardedDataParallel"]
