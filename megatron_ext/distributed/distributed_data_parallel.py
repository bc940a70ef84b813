"""A data-parallel wrapper whose gradient reductions overlap the backward pass (Megatron-core's
``DistributedDataParallel``).

The trainable parameters' gradients live in ``_ParamAndGradBuffer``s, one flat buffer per
(parameter dtype, gradient dtype) pair, cut into buckets (``param_and_grad_buffer.py`` has the
layout). A hook on each parameter counts its gradient; once every gradient of a bucket group is
there, the group's collective starts asynchronously while autograd goes on with earlier layers.
``finish_grad_sync()`` (called by ``finalize_model_grads``) starts what is left and waits.

Two modes:

* with a ``DistributedDataParallelConfig`` (Megatron-core's, or any object with its fields): every
  parameter gets ``param.main_grad``, a view into its buffer (float32 for 16-bit parameters under
  ``grad_reduce_in_fp32``); each backward's gradient is added into it and ``param.grad`` cleared.
  With ``use_distributed_optimizer`` a bucket is reduce-scattered: data-parallel rank r keeps the
  reduced r-th of dp equal slices of the (padded) bucket, the part the distributed optimizer
  updates.
* without one (this package's original API): gradients stay in ``param.grad``; after
  ``finish_grad_sync()`` they hold the data-parallel average.

With ``use_distributed_optimizer`` the wrapper also gathers the parameters back: after the
optimizer has written its updated slices into each parameter, ``start_param_sync()`` all-gathers
every bucket's slices over the data-parallel group into the parameters. Under
``overlap_param_gather`` the all-gathers are left running when the optimizer step returns and a
forward pre-hook on each module waits for the bucket(s) of the parameters that module reads, so
the gathers overlap the next forward pass (Megatron-core's design).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.comm_errors import ReportedWork, reported
from megatron_ext.distributed.distributed_data_parallel_config import as_ddp_config
from megatron_ext.distributed.param_and_grad_buffer import (
    _ParamAndGradBucket,
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    SIXTEEN_BIT,
    dist_all_gather_func,
    is_allocated,
    partition_buckets,
    shard_buffer,
)
from megatron_ext.model_parallel_config import check_config_object
from megatron_ext.process_groups_config import ProcessGroupCollection
from megatron_ext.resolve import default_group, group_rank
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict

DEFAULT_BUCKET_SIZE_BYTES = 40 * 1024 * 1024


def _is_process_group(value: Any) -> bool:
    return isinstance(value, dist.ProcessGroup)


class DistributedDataParallel(torch.nn.Module):
    """Averages gradients over a data-parallel group, overlapping the reduction with backward.

    ``DistributedDataParallel(config, ddp_config, module, disable_bucketing=False,
    pg_collection=None)`` as in Megatron-core, by position or keyword: ``config`` is the model's
    config (any object with the fields read, e.g. a ``TransformerConfig``; ``calculate_per_token_loss``
    makes the reduction a sum), ``ddp_config`` a ``DistributedDataParallelConfig`` or any object
    with its fields, ``disable_bucketing`` puts all parameters into one bucket group, and
    ``pg_collection`` (``ProcessGroupCollection``) replaces parallel_state's groups (see
    ``ProcessGroupCollection.setup_process_groups_for_ddp``). This package's original order
    ``DistributedDataParallel(module, data_parallel_group=None, *, bucket_size_bytes=None,
    ddp_config=None)`` is recognised by its first argument being the module; the keywords
    ``data_parallel_group`` and ``bucket_size_bytes`` work in both forms.

    ``module`` is kept as ``self.module``; ``forward`` calls it. The pipeline schedules and
    ``finalize_model_grads`` look through ``.module`` for ``config``, ``set_input_tensor`` and the
    shared embedding weight.

    Bucket size: ``bucket_size_bytes`` when given; else ``ddp_config.bucket_size`` elements
    (default Megatron's ``max(40e6, 1e6 * dp)``), one bucket when ``overlap_grad_reduce`` is off, on
    pipeline stages after the first or with ``disable_bucketing``; 40 MiB without a ``ddp_config``.

    As in Megatron-core, the first step records how many gradients each parameter receives and its
    collectives all start in ``finish_grad_sync()``; from the second step on a bucket group's
    collective starts during the backward as soon as its parameters have them all. Ready groups
    start in one fixed order (that of their first gradient in a backward over the parameters in
    reverse registration order), so every rank issues the same collectives in the same order.
    ``finish_grad_sync()`` starts what has not started: a parameter that got no gradient counts
    as zeros on every rank, so a parameter used on some ranks only gets the correct average.
    The reduction is a SUM after scaling by 1 / the group size (gloo has no AVG).

    Usage per step: run the backward(s) with all but the last inside ``no_sync()`` (the schedules
    do this through ``config.no_sync_func = ddp.no_sync``), then ``finish_grad_sync()`` (which
    ``finalize_model_grads`` calls), then the optimizer step; clear with ``zero_grad_buffer()``
    (``megatron_ext.optimizer``'s ``zero_grad`` calls it).

    With ``use_distributed_optimizer``, ``start_param_sync()`` gathers the optimizer's updated
    slices back into the parameters; under ``overlap_param_gather`` it leaves the gathers in
    flight, forward pre-hooks wait for them module by module (``disable_forward_pre_hook()`` /
    ``enable_forward_pre_hook()`` as in Megatron-core) and ``finish_param_sync()`` waits for all.
    A parameter that a forward reads without calling the module that owns it (e.g. an output
    layer's weight handed straight to a fused loss) is found out by the wrapper: its gradient
    arrives although no forward called its owner. From then on the wrapped model's own pre-hook
    waits for its bucket, at the top of every forward, and that bucket is gathered first.
    """

    def __init__(
        self,
        config: Any = None,
        ddp_config: Any = None,
        module: torch.nn.Module | None = None,
        disable_bucketing: bool = False,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        data_parallel_group: dist.ProcessGroup | None = None,
        bucket_size_bytes: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(config, torch.nn.Module):
            # This package's order: (module, data_parallel_group, ...).
            if module is not None:
                raise TypeError(
                    "DistributedDataParallel(module, data_parallel_group, ...): pass bucket_size_bytes and "
                    "ddp_config by keyword, or use Megatron's order (config, ddp_config, module)"
                )
            module, config = config, None
            if _is_process_group(ddp_config):
                if data_parallel_group is not None:
                    raise TypeError("DistributedDataParallel: data_parallel_group given twice")
                data_parallel_group, ddp_config = ddp_config, None
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if config is not None:
            check_config_object(config, "DistributedDataParallel")
        megatron_mode = ddp_config is not None
        ddp_config = as_ddp_config(ddp_config) if megatron_mode else None
        if megatron_mode and ddp_config.use_megatron_fsdp and not getattr(self, "_is_fsdp", False):
            raise ValueError(
                "DistributedDataParallelConfig(use_megatron_fsdp=True) is for "
                "megatron_ext.distributed.FullyShardedDataParallel, not DistributedDataParallel"
            )
        if bucket_size_bytes is not None and (
            isinstance(bucket_size_bytes, bool)
            or not isinstance(bucket_size_bytes, int)
            or bucket_size_bytes < 1
        ):
            raise ValueError(f"bucket_size_bytes must be an integer >= 1, got {bucket_size_bytes!r}")
        if not isinstance(disable_bucketing, bool):
            raise TypeError(f"disable_bucketing must be a bool, got {disable_bucketing!r}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        on_meta = [n for n, p in module.named_parameters() if p.is_meta]
        if on_meta and not getattr(self, "_is_fsdp", False):  # it draws them unit by unit
            raise ValueError(
                f"DistributedDataParallel: {on_meta[0]} (and {len(on_meta) - 1} more) is on the meta device "
                "(init_model_with_meta_device): only FullyShardedDataParallel with a sharding strategy "
                "(optim, optim_grads, optim_grads_params) draws such a model"
            )
        if not named:
            raise ValueError(
                f"{type(module).__name__} has no parameter with requires_grad=True: there is no "
                "gradient to reduce"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group() first"
            )

        self.module = module
        if config is not None:
            self.config = config
        self.ddp_config = ddp_config
        # Without a ddp_config the buckets still follow one: plain all-reduces, started during
        # the backward.
        self._buffer_config = ddp_config if megatron_mode else as_ddp_config(None, overlap_grad_reduce=True)
        self._setup_groups(pg_collection, config, data_parallel_group)
        self.data_parallel_group = self.dp_cp_group
        self._dp_size = dist.get_world_size(self.intra_dp_cp_group)
        self._dp_rank = dist.get_rank(self.intra_dp_cp_group)
        self._main_grads = megatron_mode
        self._reduce_scatter = megatron_mode and ddp_config.use_distributed_optimizer
        self._overlap = self._buffer_config.overlap_grad_reduce
        self.force_all_reduce = False
        self.overlap_param_gather_with_optimizer_step = False

        # Bucket size, in elements (None: one bucket), or per buffer from bucket_size_bytes.
        pp_rank = group_rank(self.pp_group)
        if not megatron_mode:
            bucket_size_bytes = bucket_size_bytes or DEFAULT_BUCKET_SIZE_BYTES
            self.bucket_size = None
        else:
            dp_size = dist.get_world_size(self.dp_group)
            self.bucket_size = ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp_size)
            if not ddp_config.overlap_grad_reduce or pp_rank > 0:
                self.bucket_size = None
        if disable_bucketing:
            self.bucket_size, bucket_size_bytes = None, None
        self.bucket_size_bytes = bucket_size_bytes

        sum_not_average = bool(getattr(config, "calculate_per_token_loss", False))
        if sum_not_average and self._buffer_config.average_in_collective:
            raise ValueError(
                "DistributedDataParallel: average_in_collective cannot be combined with "
                "calculate_per_token_loss"
            )
        if sum_not_average or self._buffer_config.average_in_collective:
            self.gradient_scaling_factor = 1.0
        else:
            self.gradient_scaling_factor = 1.0 / dist.get_world_size(self.dp_cp_group)
        # finalize_model_grads' per-token scaling needs to know whether these are sums or means.
        self.grads_are_summed = sum_not_average

        self.params_with_grad = [p for _, p in named]
        # Expert parameters (allreduce=False, as Megatron-core marks them) have buffers of their
        # own, reduced over the expert-data-parallel group; ``buffers`` and ``bucket_groups``
        # hold both kinds.
        expert = [(n, p) for n, p in named if not getattr(p, "allreduce", True)]
        if expert and self.intra_expt_dp_group is None:
            raise ValueError(
                f"DistributedDataParallel: expert parameters (allreduce=False: {[n for n, _ in expert][:3]}) "
                "need the expert-data-parallel group: initialise parallel_state with "
                "expert_model_parallel_size or pass a pg_collection with expt_dp"
            )
        dense = [(n, p) for n, p in named if getattr(p, "allreduce", True)]
        self.buffers, self.bucket_groups = self._allocate_buffers(dense, disable_bucketing)
        self.expert_parallel_buffers, self.expert_parallel_bucket_groups = self._allocate_buffers(
            expert, disable_bucketing, expert=True
        )
        self.buffers = self.buffers + self.expert_parallel_buffers
        self.bucket_groups = self.bucket_groups + self.expert_parallel_bucket_groups
        self._bucket_buffer = {id(b): buffer for buffer in self.buffers for b in buffer.buckets}
        self.param_to_bucket_group = {p: g for g in self.bucket_groups for p in g.params}
        self._launch_order = self._order_of_first_gradient(named)
        for group in self.bucket_groups:
            group.dispatch = self._start_ready_groups
            group.grads_in_param_grad = not megatron_mode
            if self.inter_dist_opt_group is not None:
                group.inter_distributed_optimizer_instance_group = self.inter_dist_opt_group
        self._buckets = [b for g in self._launch_order for b in g.buckets]
        self._bucket_of = {p: b for b in self._buckets for p in b.params_list}

        if megatron_mode:
            for buffer in self.buffers:
                for p in buffer.params:
                    # (FullyShardedDataParallel's sharded gradients have no full buffer yet.)
                    p.main_grad = buffer.grad_view(p) if is_allocated(buffer.grad_data) else None
                    # Set by gradient_accumulation_fusion's backward, which then hands autograd a
                    # placeholder gradient so that this wrapper's hook still fires.
                    p.grad_added_to_main_grad = False
        self._hook_handles: list[Any] = []
        self._active = megatron_mode or dist.get_world_size(self.dp_cp_group) > 1
        if self._active:
            # The hook holds the wrapper weakly: a parameter keeps its hooks on the C++ side, out of
            # the garbage collector's reach, so a bound method would keep every wrapper ever built
            # (its module, buffers and process groups) alive as long as the parameters live.
            on_grad_ready = weakref.WeakMethod(self._on_grad_ready)

            def hook(param: torch.nn.Parameter) -> None:
                method = on_grad_ready()
                if method is not None:
                    method(param)

            for p in self.params_with_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

        # Parameter all-gathers (distributed optimizer): each module's forward pre-hook waits for
        # the buckets of the parameters that module reads.
        self._overlap_param_gather = self._reduce_scatter and ddp_config.overlap_param_gather
        self.use_forward_hook = self._overlap_param_gather
        self._own_params: dict[torch.nn.Module, list[torch.Tensor]] = {module: []}
        self._owners: dict[torch.nn.Parameter, list[torch.nn.Module]] = {}
        for m in module.modules():
            params = [p for p in m.parameters(recurse=False) if p in self._bucket_of]
            if params:
                self._own_params[m] = params
            for p in params:
                self._owners.setdefault(p, []).append(m)
        # Modules whose forward ran since the last parameter gather, and the parameters found to
        # be read by a forward that did not call their owner.
        self._called: set[torch.nn.Module] = set()
        self._read_outside_owner: dict[torch.nn.Parameter, None] = {}
        self.remove_forward_pre_hook_handles: dict[torch.nn.Module, Any] = {}
        if self.use_forward_hook:
            self.enable_forward_pre_hook()
        if self._overlap_param_gather:
            # Nothing reads or overwrites parameters through a state dict while a gather is in flight.
            for m in module.modules():
                m.register_state_dict_pre_hook(lambda *unused: self.finish_param_sync())
                m.register_load_state_dict_pre_hook(lambda *unused: self.finish_param_sync())

    def _setup_groups(self, pg_collection: Any, config: Any, data_parallel_group: Any) -> None:
        if data_parallel_group is not None or (
            pg_collection is None and not parallel_state.model_parallel_is_initialized()
        ):
            if pg_collection is not None:
                raise TypeError("DistributedDataParallel: pass either pg_collection or data_parallel_group")
            if self._buffer_config.num_distributed_optimizer_instances > 1:
                raise ValueError(
                    "num_distributed_optimizer_instances > 1 needs parallel_state's groups or a pg_collection"
                )
            group = data_parallel_group if data_parallel_group is not None else dist.group.WORLD
            initialized = parallel_state.model_parallel_is_initialized()
            groups = {
                "dp_group": group, "dp_cp_group": group, "intra_dp_cp_group": group,
                # The expert-data-parallel group comes from parallel_state where it exists.
                "expt_dp_group": default_group("expt_dp", check_initialized=False) if initialized else None,
                "intra_expt_dp_group": (
                    default_group("intra_expt_dp", check_initialized=False) if initialized else None
                ),
                "tp_group": parallel_state.get_tensor_model_parallel_group() if initialized else None,
                "pp_group": parallel_state.get_pipeline_model_parallel_group() if initialized else None,
                "ep_group": None, "inter_dist_opt_group": None, "intra_dist_opt_group": None,
            }
        else:
            groups = ProcessGroupCollection.setup_process_groups_for_ddp(
                pg_collection, config, self._buffer_config
            )
        for key, group in groups.items():
            setattr(self, key, group)

    def _allocate_buffers(
        self, named: list[tuple[str, torch.nn.Parameter]], disable_bucketing: bool, expert: bool = False
    ) -> tuple[list[_ParamAndGradBuffer], list[_ParamAndGradBucketGroup]]:
        """One buffer per (parameter dtype, gradient dtype, device), in order of first appearance;
        expert parameters' over the expert-data-parallel group, scaled like the others by 1 / the
        data-parallel size (the loss is the mean over the data-parallel ranks; the expert copies'
        sum over expert-data-parallel ranks covers all of them)."""
        group, scaling = self.intra_dp_cp_group, self.gradient_scaling_factor
        if expert:
            group = self.intra_expt_dp_group
            if self._buffer_config.average_in_collective:
                scaling = dist.get_world_size(group) / dist.get_world_size(self.dp_cp_group)
        fp32_grads = self._buffer_config.grad_reduce_in_fp32 and self._main_grads
        by_kind: dict[tuple, list[torch.nn.Parameter]] = {}
        for _, p in named:
            grad_dtype = torch.float32 if fp32_grads and p.dtype in SIXTEEN_BIT else p.dtype
            by_kind.setdefault((p.dtype, grad_dtype, p.device), []).append(p)
        names = {p: n for n, p in named}
        buffers = []
        for (param_dtype, grad_dtype, _), params in by_kind.items():
            bucket_size = self.bucket_size
            if self.bucket_size_bytes is not None:
                bucket_size = max(1, self.bucket_size_bytes // grad_dtype.itemsize)
            buffers.append(_ParamAndGradBuffer(
                self._buffer_config, param_dtype, grad_dtype, params, group, bucket_size,
                names, scaling,
            ))
        return buffers, partition_buckets(buffers, force_single_bucket_group=disable_bucketing)

    def _order_of_first_gradient(
        self, named: list[tuple[str, torch.nn.Parameter]]
    ) -> list[_ParamAndGradBucketGroup]:
        """The bucket groups in the order a backward over the parameters in reverse registration
        order completes them: the same on every rank."""
        position = {p: i for i, (_, p) in enumerate(reversed(named))}
        return sorted(self.bucket_groups, key=lambda g: max(position[p] for p in g.params))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # State dicts, as Megatron-core's wrapper gives them ------------------------------------------

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's state dict (no ``module.`` in the names)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Megatron-core's name for ``state_dict`` (Megatron-LM's torch-format checkpoints)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False) -> Any:
        """Into the wrapped module (names as ``state_dict()`` gives them)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The wrapped module's sharded state dict under ``prefix + "module."`` (what
        Megatron-core's wrapper, a MegatronModule, gives through its one child; its training
        loop unwraps the model first). A module without ``sharded_state_dict`` gets the default
        one: every tensor sharded as its tensor-parallel attributes say, else replicated."""
        inner = f"{prefix}module."
        if hasattr(self.module, "sharded_state_dict"):
            return self.module.sharded_state_dict(inner, sharded_offsets, metadata)
        return module_sharded_state_dict(self.module, inner, sharded_offsets)

    # Introspection --------------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """The parameter names of each bucket, in launch order."""
        return tuple(tuple(b.names) for b in self._buckets)

    @property
    def grad_buckets(self) -> tuple[_ParamAndGradBucket, ...]:
        """The buckets themselves (parameters, offsets, ``grad_data``) in launch order: what the
        distributed optimizer shards."""
        return tuple(self._buckets)

    @property
    def launched_buckets(self) -> int:
        """How many buckets' collectives have started since the last ``finish_grad_sync()``."""
        return sum(len(g.buckets) for g in self.bucket_groups if g.grad_reduce_dispatched)

    # Gradient synchronisation ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside this context only accumulate gradients; nothing is reduced until a
        backward outside it (or ``finish_grad_sync()``)."""
        previous = [g.is_last_microbatch for g in self.bucket_groups]
        for g in self.bucket_groups:
            g.is_last_microbatch = False
        try:
            yield
        finally:
            for g, value in zip(self.bucket_groups, previous):
                g.is_last_microbatch = value

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        group = self.param_to_bucket_group[param]
        if group.grad_reduce_dispatched:
            # The bucket's gradients were already sent: this one would be lost.
            bucket = group.param_to_bucket[param]
            name = bucket.names[next(i for i, p in enumerate(bucket.params_list) if p is param)]
            raise RuntimeError(
                f"parameter {name!r} received a gradient after the collective of its bucket "
                f"({bucket.bucket_id}) had started: call finish_grad_sync() after the last backward "
                "of a step and run earlier backwards inside no_sync()"
            )
        if self.remove_forward_pre_hook_handles and param not in self._read_outside_owner:
            if not any(owner in self._called for owner in self._owners[param]):
                self._read_outside_owner[param] = None
        if self._main_grads and param.grad is not None:
            if not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
        if self._overlap:
            group.register_grad_ready(param, self.force_all_reduce)

    def _start_ready_groups(self, force_all_reduce: bool = False) -> None:
        """Starts, in launch order, every group not yet started whose predecessors have started
        and that is ready."""
        for group in self._launch_order:
            if group.grad_reduce_dispatched:
                continue
            if not group.is_ready():
                return
            group.start_grad_sync(force_all_reduce)

    def start_grad_sync(self, *unused: Any) -> None:
        """Starts, in launch order, every bucket group's collective not yet started."""
        for group in self._launch_order:
            if not group.grad_reduce_dispatched:
                group.start_grad_sync(self.force_all_reduce)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Starts the bucket groups not yet started (in launch order) and waits for every
        collective; without a ``ddp_config`` writes the averages into ``param.grad``. Ends the
        step (the next backward counts gradients afresh). ``force_all_reduce`` all-reduces
        instead of reduce-scattering."""
        if not self._active:
            return
        try:
            if self._overlap:
                for group in self._launch_order:
                    if not group.grad_reduce_dispatched:
                        group.start_grad_sync(force_all_reduce)
            for group in self._launch_order:
                group.finish_grad_sync(force_all_reduce)
        finally:
            for group in self.bucket_groups:
                group.reset()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiplies every gradient (the buffers; ``param.grad`` without a ``ddp_config``)."""
        if self._main_grads:
            for buffer in self.buffers:
                buffer.scale_gradients(scaling_factor)
        else:
            for p in self.params_with_grad:
                if p.grad is not None:
                    p.grad.mul_(scaling_factor)

    def broadcast_params(self) -> None:
        """Copies data-parallel rank 0's parameters to the other data-parallel ranks."""
        src = dist.get_global_rank(self.dp_cp_group, 0)
        for p in self.module.parameters():
            dist.broadcast(p.data, src=src, group=self.dp_cp_group)

    def zero_grad_buffer(self) -> None:
        """Clears every gradient (``param.grad`` to None, the buffers to zero) and ends the step,
        waiting first for any collective in flight."""
        for group in self.bucket_groups:
            group.reset()
        for buffer in self.buffers:
            buffer.reset()
        for p in self.params_with_grad:
            p.grad = None
            if self._main_grads:
                p.grad_added_to_main_grad = False

    # Parameter synchronisation (distributed optimizer) ---------------------------------------

    def bucket_data_parallel_group(self, bucket: _ParamAndGradBucket) -> dist.ProcessGroup:
        """The group ``bucket`` is reduced (and sharded) over: the data-parallel group, or the
        expert-data-parallel group for expert parameters."""
        return self._bucket_buffer[id(bucket)].data_parallel_group

    def shard_range(self, bucket: _ParamAndGradBucket) -> tuple[int, int]:
        """The ``[start, end)`` of ``bucket``'s ``grad_data`` this data-parallel rank owns under
        the distributed optimizer (the whole bucket otherwise)."""
        if not self._reduce_scatter:
            return 0, bucket.padded_numel
        group = self.bucket_data_parallel_group(bucket)
        size = bucket.padded_numel // dist.get_world_size(group)
        rank = dist.get_rank(group)
        return rank * size, (rank + 1) * size

    def param_shard(self, bucket: _ParamAndGradBucket) -> torch.Tensor:
        """The part of ``bucket``'s parameters this rank's optimizer updates (``shard_range``), a
        view of the parameters themselves."""
        lo, hi = self.shard_range(bucket)
        if bucket.param_data is None:
            raise RuntimeError(
                "param_shard needs DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )
        return bucket.param_data[lo:hi]

    def grad_shard(self, bucket: _ParamAndGradBucket) -> torch.Tensor:
        """The part of ``bucket``'s gradients this rank owns once they are reduced."""
        lo, hi = self.shard_range(bucket)
        return bucket.grad_data[lo:hi]

    def _require_param_gather(self, what: str) -> None:
        if not self._reduce_scatter:
            raise RuntimeError(
                f"DistributedDataParallel.{what} gathers the distributed optimizer's parameter "
                "slices: build the wrapper with DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )

    def _start_bucket_param_sync(self, bucket: _ParamAndGradBucket) -> None:
        """Starts the asynchronous all-gather of ``bucket``'s parameter slices, in place: this
        rank's slice of the bucket's parameter buffer (which its parameters view) is the input,
        the whole bucket the output."""
        group = self.bucket_data_parallel_group(bucket)
        local = shard_buffer(bucket.param_data, dist.get_world_size(group))[dist.get_rank(group)]
        what = f"all-gather of the parameters of {bucket.describe()}"
        with reported(what, group, tensor=local):
            work = dist_all_gather_func(bucket.param_data, local, group=group, async_op=True)
        bucket.param_gather = (ReportedWork(work, what, group, tensor=local), bucket.param_data)

    @staticmethod
    def _finish_bucket_param_sync(bucket: _ParamAndGradBucket) -> None:
        """Waits for ``bucket``'s all-gather, if one is in flight (it writes into the
        parameters themselves)."""
        if bucket.param_gather is None:
            return
        work, _ = bucket.param_gather
        bucket.param_gather = None
        work.wait()

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """All-gathers every bucket's parameter slices over the data-parallel group into the
        parameters (the distributed optimizer calls it after writing its updated slices).

        With ``overlap_param_gather`` the all-gathers are started and left running (a bucket
        whose gather is already in flight is not started again); the forward pre-hooks, or
        ``finish_param_sync()``, wait for them. Otherwise, or with ``force_sync``, it returns
        with the parameters gathered: gathers in flight are waited for, the other buckets
        gathered now. ``force_dispatch`` is accepted for Megatron-core's signature (it only
        matters with ``overlap_param_gather_with_optimizer_step``, which is not supported)."""
        self._require_param_gather("start_param_sync")
        # A bucket reduced over one rank holds its parameters whole.
        order = [b for b in self._param_gather_order() if self.bucket_data_parallel_group(b).size() > 1]
        self._called.clear()  # the next forwards show again which owners they call
        pending = [b for b in order if b.param_gather is not None]
        started = [b for b in order if b.param_gather is None]
        for bucket in started:
            self._start_bucket_param_sync(bucket)
        if force_sync or not self._overlap_param_gather:
            for bucket in pending + started:
                self._finish_bucket_param_sync(bucket)

    def finish_param_sync(self) -> None:
        """Waits for every parameter all-gather in flight and writes the gathered values into
        the parameters; nothing to do when none is in flight. Reading parameters outside the
        forward (evaluation with the hooks off, a checkpoint) needs it first; the optimizer
        step, the state-dict methods and ``megatron_ext.dist_checkpointing`` call it."""
        for bucket in self._buckets:
            self._finish_bucket_param_sync(bucket)

    @property
    def param_gather_in_flight(self) -> bool:
        """True while an all-gather of parameters has started and not been waited for."""
        return any(b.param_gather is not None for b in self._buckets)

    def _param_gather_order(self) -> list[_ParamAndGradBucket]:
        """The order in which the forward needs the buckets: those read outside their owner (at
        the top of a forward) first, then by reverse launch order (the first layers' parameters
        are in the last buckets)."""
        first = [self._bucket_of[p] for p in self._read_outside_owner]
        order: list[_ParamAndGradBucket] = []
        for bucket in first + self._buckets[::-1]:
            if all(bucket is not b for b in order):
                order.append(bucket)
        return order

    def _forward_pre_hook(self, module: torch.nn.Module, *unused: Any) -> None:
        self._called.add(module)
        waits = self._own_params[module]
        if module is self.module:
            waits = waits + list(self._read_outside_owner)
        for p in waits:
            self._finish_bucket_param_sync(self._bucket_of[p])

    def enable_forward_pre_hook(self) -> None:
        """Registers the forward pre-hooks that wait for the all-gather of each module's
        parameters (on by default with ``overlap_param_gather``)."""
        if not self.use_forward_hook:
            raise RuntimeError(
                "enable_forward_pre_hook needs "
                "DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)"
            )
        if self.remove_forward_pre_hook_handles:
            raise RuntimeError("the forward pre-hooks are already enabled")
        for m in self._own_params:
            self.remove_forward_pre_hook_handles[m] = m.register_forward_pre_hook(self._forward_pre_hook)

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Removes the forward pre-hooks (e.g. for an evaluation); with ``param_sync`` the
        parameters are then gathered synchronously (``start_param_sync(force_sync=True)``), so
        the forwards without hooks read the updated values."""
        if not self.use_forward_hook:
            raise RuntimeError(
                "disable_forward_pre_hook needs "
                "DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)"
            )
        if not self.remove_forward_pre_hook_handles:
            raise RuntimeError("the forward pre-hooks are already disabled")
        for handle in self.remove_forward_pre_hook_handles.values():
            handle.remove()
        self.remove_forward_pre_hook_handles.clear()
        if param_sync:
            self.start_param_sync(force_sync=True)

    def extra_repr(self) -> str:
        mode = "reduce-scatter" if self._reduce_scatter else "all-reduce"
        return f"data_parallel_size={self._dp_size}, buckets={len(self._buckets)}, {mode}"

