"""A data-parallel wrapper whose gradient reductions overlap the backward pass.

Parameters are grouped into buckets (``partition_into_buckets``, the one bucketer of the package,
also used by ``finalize_model_grads.allreduce_gradients``). A hook on each parameter notes when
its gradient for the current backward is complete; once every parameter of a bucket is complete,
the bucket's collective starts asynchronously while autograd goes on computing the gradients of
earlier layers. ``finish_grad_sync()`` (called by ``finalize_model_grads``) starts what is left
and waits.

Two modes:

* without ``ddp_config`` (this package's original API): gradients stay in ``param.grad``; after
  ``finish_grad_sync()`` they hold the data-parallel average.
* with a ``DistributedDataParallelConfig`` (Megatron-core's): every parameter gets
  ``param.main_grad``, a view into a persistent flat bucket buffer (float32 for 16-bit
  parameters when ``grad_reduce_in_fp32``). Each backward's gradient is added into it and
  ``param.grad`` is cleared, as Megatron-core does. With ``use_distributed_optimizer`` a
  bucket is reduce-scattered: data-parallel rank r receives the average of the r-th of ``dp``
  equal slices of the (padded) bucket, which is the part the distributed optimizer updates.

With ``use_distributed_optimizer`` the wrapper also gathers the parameters back: after the
optimizer has written its updated slices into each parameter, ``start_param_sync()`` all-gathers
every bucket's slices over the data-parallel group into the parameters. Under
``overlap_param_gather`` the all-gathers are left running when the optimizer step returns and a
forward pre-hook on each module waits for the bucket(s) of that module's own parameters, so the
gathers overlap the next forward pass (Megatron-core's design).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext._torch_compat import all_gather_single, reduce_scatter_single
from megatron_ext.comm_errors import ReportedWork, reported
from megatron_ext.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_ext.model_parallel_config import ModelParallelConfig

DEFAULT_BUCKET_SIZE_BYTES = 40 * 1024 * 1024

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@dataclass
class _Bucket:
    """Parameters whose gradients travel in one flat collective.

    ``offsets[i]`` is where parameter i starts in the flat buffer; ``padded_numel`` is ``numel``
    rounded up to a multiple of the padding (the data-parallel size for reduce-scatter)."""

    index: int
    dtype: torch.dtype
    device: torch.device
    element_size: int
    params: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    padded_numel: int = 0
    grad_data: torch.Tensor | None = None
    # Per-step state: ids of the parameters whose gradient is complete.
    ready: set[int] = field(default_factory=set)
    # An all-gather of the parameters in flight: (work, gathered flat buffer).
    param_gather: tuple[Any, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)

    def describe(self) -> str:
        """For a failed collective's message: ``bucket 0 (3 parameters, 'a' ... 'c')``."""
        if len(self.names) == 1:
            return f"bucket {self.index} (1 parameter, {self.names[0]!r})"
        return f"bucket {self.index} ({len(self.names)} parameters, {self.names[0]!r} ... {self.names[-1]!r})"


def partition_into_buckets(
    named: list[tuple[str, torch.Tensor]],
    bucket_size_bytes: int,
    grad_dtype: dict[int, torch.dtype] | None = None,
    pad_to: int = 1,
) -> list[_Bucket]:
    """Groups ``named`` tensors into buckets of one (gradient) dtype and device, taken in reverse
    order (close to the order in which backward produces the gradients), up to
    ``bucket_size_bytes`` each; a larger tensor gets a bucket of its own, and so does a
    ``shared_embedding`` parameter (its gradient is also summed over the embedding group, which
    needs the same slicing on the first and last pipeline stage). ``grad_dtype`` maps ``id(t)`` to
    the gradient dtype where it differs from ``t.dtype``."""
    buckets: list[_Bucket] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], _Bucket] = {}

    def new_bucket(dtype: torch.dtype, device: torch.device) -> _Bucket:
        bucket = _Bucket(index=len(buckets), dtype=dtype, device=device,
                         element_size=torch.empty(0, dtype=dtype).element_size())
        buckets.append(bucket)
        return bucket

    for name, t in reversed(named):
        dtype = (grad_dtype or {}).get(id(t), t.dtype)
        key = (dtype, t.device)
        alone = getattr(t, "shared_embedding", False)
        bucket = open_bucket.get(key)
        size = t.numel() * torch.empty(0, dtype=dtype).element_size()
        if alone or bucket is None or (bucket.params and bucket.nbytes + size > bucket_size_bytes):
            bucket = new_bucket(dtype, t.device)
            open_bucket[key] = bucket
        bucket.params.append(t)
        bucket.names.append(name)
        bucket.offsets.append(bucket.numel)
        bucket.numel += t.numel()
        if alone:
            open_bucket.pop(key)
    for bucket in buckets:
        bucket.padded_numel = -(-bucket.numel // pad_to) * pad_to
    return buckets


def _default_data_parallel_group() -> dist.ProcessGroup:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group()
    return dist.group.WORLD


class DistributedDataParallel(torch.nn.Module):
    """Averages gradients over a data-parallel group, overlapping the reduction with backward.

    ``DistributedDataParallel(module, data_parallel_group=None, bucket_size_bytes=None,
    ddp_config=None)``; Megatron-core's order ``DistributedDataParallel(config, ddp_config,
    module)`` is accepted too (the first argument is then a ``TransformerConfig``).

    ``module`` is kept as ``self.module``; ``forward`` calls it. The pipeline schedules and
    ``finalize_model_grads`` look through ``.module`` for ``config``, ``set_input_tensor`` and
    the shared embedding weight.

    A bucket's collective starts as soon as all its gradients are complete and every earlier
    bucket has started (with a ``ddp_config``, only when ``overlap_grad_reduce``): buckets start
    strictly in index order, so every rank issues the same collectives in the same order whatever
    order its hooks fire in. Bucket size: ``bucket_size_bytes``, else ``ddp_config.bucket_size``
    elements, else 40 MiB (Megatron's ``max(40e6, 1e6 * dp)`` elements with a ``ddp_config``).

    Usage per step: run the backward(s) with all but the last inside ``no_sync()`` (the schedules
    do this through ``config.no_sync_func = ddp.no_sync``), then ``finish_grad_sync()`` (which
    ``finalize_model_grads`` calls), then the optimizer step. Clear gradients with
    ``zero_grad_buffer()`` (``megatron_ext.optimizer``'s ``zero_grad`` calls it); without a
    ``ddp_config`` the torch optimizer's ``zero_grad()`` is enough.

    After ``finish_grad_sync()`` every trainable parameter has a gradient: a parameter that got
    none on this rank contributes zeros, so all ranks reduce the same buffers and a parameter
    used only on some ranks gets the correct average. The reduction is a SUM followed by a
    division by the group size (gloo has no AVG).

    With ``use_distributed_optimizer``, ``start_param_sync()`` gathers the optimizer's updated
    slices back into the parameters; under ``overlap_param_gather`` it leaves the gathers in
    flight, forward pre-hooks wait for them module by module (``disable_forward_pre_hook()`` /
    ``enable_forward_pre_hook()`` as in Megatron-core) and ``finish_param_sync()`` waits for all.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        data_parallel_group: dist.ProcessGroup | None = None,
        bucket_size_bytes: int | None = None,
        ddp_config: DistributedDataParallelConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(module, ModelParallelConfig):  # Megatron-core's (config, ddp_config, module)
            module, ddp_config, data_parallel_group = bucket_size_bytes, data_parallel_group, None
            bucket_size_bytes = None
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if ddp_config is not None and not isinstance(ddp_config, DistributedDataParallelConfig):
            raise TypeError(
                f"ddp_config must be a DistributedDataParallelConfig, got {type(ddp_config).__name__}"
            )
        if bucket_size_bytes is not None and (
            isinstance(bucket_size_bytes, bool)
            or not isinstance(bucket_size_bytes, int)
            or bucket_size_bytes < 1
        ):
            raise ValueError(f"bucket_size_bytes must be an integer >= 1, got {bucket_size_bytes!r}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
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
        if data_parallel_group is None:
            data_parallel_group = _default_data_parallel_group()
        self.module = module
        self.ddp_config = ddp_config
        self.data_parallel_group = data_parallel_group
        self._dp_size = dist.get_world_size(data_parallel_group)
        self._dp_rank = dist.get_rank(data_parallel_group)
        self._main_grads = ddp_config is not None
        self._reduce_scatter = self._main_grads and ddp_config.use_distributed_optimizer
        self._overlap = ddp_config.overlap_grad_reduce if self._main_grads else True

        grad_dtype = {}
        if self._main_grads and ddp_config.grad_reduce_in_fp32:
            grad_dtype = {id(p): torch.float32 for _, p in named if p.dtype in _SIXTEEN_BIT}
        if bucket_size_bytes is None:
            if ddp_config is None:
                bucket_size_bytes = DEFAULT_BUCKET_SIZE_BYTES
            else:
                elements = ddp_config.bucket_size or max(40_000_000, 1_000_000 * self._dp_size)
                bucket_size_bytes = elements * max(p.element_size() for _, p in named)
        self.bucket_size_bytes = bucket_size_bytes
        self._buckets = partition_into_buckets(
            named, bucket_size_bytes, grad_dtype, pad_to=self._dp_size if self._reduce_scatter else 1
        )
        self._bucket_of: dict[int, _Bucket] = {id(p): b for b in self._buckets for p in b.params}
        if self._main_grads:
            for bucket in self._buckets:
                bucket.grad_data = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
                for p, offset in zip(bucket.params, bucket.offsets):
                    p.main_grad = bucket.grad_data[offset : offset + p.numel()].view_as(p)
                    # Set by gradient_accumulation_fusion's backward, which then hands autograd a
                    # placeholder gradient so that this wrapper's hook still fires.
                    p.grad_added_to_main_grad = False
        self._sync_enabled = True
        self._next_launch = 0  # buckets [0, _next_launch) have started this step
        self._works: list[tuple[Any, torch.Tensor]] = []
        self._hook_handles: list[Any] = []
        if self._dp_size > 1 or self._main_grads:
            for _, p in named:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

        # Parameter all-gathers (distributed optimizer): each module's forward pre-hook waits
        # for the buckets of the parameters that module owns.
        self._overlap_param_gather = self._reduce_scatter and ddp_config.overlap_param_gather
        self.use_forward_hook = self._overlap_param_gather
        self._own_params: dict[torch.nn.Module, list[torch.Tensor]] = {}
        for m in module.modules():
            params = [p for p in m.parameters(recurse=False) if id(p) in self._bucket_of]
            if params or isinstance(getattr(m, "output_layer", None), torch.nn.Module):
                self._own_params[m] = params
        self.remove_forward_pre_hook_handles: dict[torch.nn.Module, Any] = {}
        if self.use_forward_hook:
            self.enable_forward_pre_hook()
        if self._overlap_param_gather:
            # Nothing reads or overwrites parameters through a state dict while a gather is in flight.
            for m in module.modules():
                m.register_state_dict_pre_hook(lambda *unused: self.finish_param_sync())
                m.register_load_state_dict_pre_hook(lambda *unused: self.finish_param_sync())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # Introspection --------------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """The parameter names of each bucket, in launch order."""
        return tuple(tuple(b.names) for b in self._buckets)

    @property
    def grad_buckets(self) -> tuple[_Bucket, ...]:
        """The buckets themselves (parameters, offsets, flat ``grad_data``): what the
        distributed optimizer shards."""
        return tuple(self._buckets)

    @property
    def launched_buckets(self) -> int:
        """How many buckets' collectives have started since the last ``finish_grad_sync()``."""
        return self._next_launch

    # Gradient synchronisation ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside this context only accumulate gradients; nothing is reduced until a
        backward outside it (or ``finish_grad_sync()``)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.index < self._next_launch:
            # The bucket's gradients were already copied and sent: this one would be lost.
            name = bucket.names[[id(p) for p in bucket.params].index(id(param))]
            raise RuntimeError(
                f"parameter {name!r} received a gradient after the all-reduce of its bucket "
                f"({bucket.index}) had started: call finish_grad_sync() after the last backward "
                "of a step, run earlier backwards inside no_sync(), and do not use a parameter "
                "both inside and outside an activation-checkpointed region"
            )
        if self._main_grads and param.grad is not None:
            if not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
        if not self._sync_enabled:
            return
        bucket.ready.add(id(param))
        if self._overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].is_ready():
            self._launch(self._buckets[self._next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        self._next_launch += 1
        if self._dp_size == 1:
            return
        if self._main_grads:
            flat = bucket.grad_data
            if self.ddp_config.check_for_nan_in_grad and not bool(torch.isfinite(flat).all()):
                raise RuntimeError(
                    f"DistributedDataParallel: a gradient in bucket {bucket.index} ({bucket.names[:3]}...) "
                    "is NaN or infinite before its reduction (check_for_nan_in_grad)"
                )
        else:
            # A flat copy: the reduction runs while autograd keeps writing other gradients.
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            for p, offset in zip(bucket.params, bucket.offsets):
                chunk = flat[offset : offset + p.numel()]
                if p.grad is None:
                    chunk.zero_()  # every rank must reduce the same buffers
                else:
                    chunk.copy_(p.grad.reshape(-1))
        # Scaled by 1/dp before the sum, as Megatron-core does: a sum of loss-scaled 16-bit
        # gradients over many ranks could overflow where their mean does not.
        flat.mul_(1.0 / self._dp_size)
        group = self.data_parallel_group
        if self._reduce_scatter:
            shard = self._shard(bucket)
            what = f"reduce-scatter of the gradients of {bucket.describe()}"
            with reported(what, group, tensor=flat):
                work = reduce_scatter_single(shard, flat, group=group, async_op=True)
            self._works.append((ReportedWork(work, what, group, tensor=flat), shard))
        else:
            what = f"all-reduce of the gradients of {bucket.describe()}"
            with reported(what, group, tensor=flat):
                work = dist.all_reduce(flat, group=group, async_op=True)
            self._works.append((ReportedWork(work, what, group, tensor=flat), flat))

    def _shard(self, bucket: _Bucket) -> torch.Tensor:
        size = bucket.padded_numel // self._dp_size
        return bucket.grad_data[self._dp_rank * size : (self._dp_rank + 1) * size]

    def shard_range(self, bucket: _Bucket) -> tuple[int, int]:
        """The ``[start, end)`` of ``bucket``'s flat buffer this data-parallel rank owns under
        the distributed optimizer (the whole bucket otherwise)."""
        if not self._reduce_scatter:
            return 0, bucket.numel
        size = bucket.padded_numel // self._dp_size
        return self._dp_rank * size, (self._dp_rank + 1) * size

    def start_grad_sync(self) -> None:
        """Starts every bucket's collective not yet started (Megatron-core's name)."""
        while self._next_launch < len(self._buckets):
            self._launch(self._buckets[self._next_launch])

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Starts the buckets not yet started (in index order) and waits for every collective
        (each bucket was scaled by 1 / the data-parallel size before its sum); without a
        ``ddp_config`` writes the averages into ``param.grad``. Resets the per-step state."""
        if force_all_reduce:
            raise NotImplementedError("finish_grad_sync(force_all_reduce=True) is not supported")
        if self._dp_size == 1:
            self._reset()
            return
        try:
            self.start_grad_sync()
            for bucket, (work, flat) in zip(self._buckets, self._works):
                work.wait()
                if self._main_grads:
                    continue
                for p, offset in zip(bucket.params, bucket.offsets):
                    value = flat[offset : offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
        finally:
            self._reset()

    # Parameter synchronisation (distributed optimizer) ---------------------------------------

    def _require_param_gather(self, what: str) -> None:
        if not self._reduce_scatter:
            raise RuntimeError(
                f"DistributedDataParallel.{what} gathers the distributed optimizer's parameter "
                "slices: build the wrapper with DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )

    def _param_dtype(self, bucket: _Bucket) -> torch.dtype:
        # The widest parameter dtype of the bucket: the gather loses nothing.
        return max((p.dtype for p in bucket.params), key=lambda t: t.itemsize)

    def _start_bucket_param_sync(self, bucket: _Bucket) -> None:
        """Starts the asynchronous all-gather of ``bucket``'s parameter slices: this rank sends
        the part of each parameter that lies in its slice of the bucket."""
        lo, hi = self.shard_range(bucket)
        dtype = self._param_dtype(bucket)
        mine = torch.zeros(hi - lo, dtype=dtype, device=bucket.device)  # zeros: the padding
        for p, offset in zip(bucket.params, bucket.offsets):
            a, b = max(offset, lo), min(offset + p.numel(), hi)
            if a < b:
                mine[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - offset : b - offset])
        full = torch.empty(bucket.padded_numel, dtype=dtype, device=bucket.device)
        what, group = f"all-gather of the parameters of {bucket.describe()}", self.data_parallel_group
        with reported(what, group, tensor=mine):
            work = all_gather_single(full, mine, group=group, async_op=True)
        bucket.param_gather = (ReportedWork(work, what, group, tensor=mine), full)

    def _finish_bucket_param_sync(self, bucket: _Bucket) -> None:
        """Waits for ``bucket``'s all-gather, if one is in flight, and writes the gathered values
        into its parameters."""
        if bucket.param_gather is None:
            return
        work, full = bucket.param_gather
        bucket.param_gather = None
        work.wait()
        with torch.no_grad():
            for p, offset in zip(bucket.params, bucket.offsets):
                p.view(-1).copy_(full[offset : offset + p.numel()])

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
        if self._dp_size == 1:
            return  # every parameter is whole on the one rank
        order = self._param_gather_order()
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

    def _params_read_outside_owner(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """Parameters ``module``'s forward reads without calling the module that owns them:
        GPTModel's fused output layer + cross-entropy reads the output layer's weight."""
        output_layer = getattr(module, "output_layer", None)
        if isinstance(output_layer, torch.nn.Module) and getattr(
            getattr(module, "config", None), "fused_output_cross_entropy", False
        ):
            return [p for p in output_layer.parameters(recurse=False) if id(p) in self._bucket_of]
        return []

    def _param_gather_order(self) -> list[_Bucket]:
        """The order in which the forward needs the buckets: those read at the top of a forward
        first, then by reverse index (the first layers' parameters are in the last buckets)."""
        first = [self._bucket_of[id(p)] for m in self._own_params for p in self._params_read_outside_owner(m)]
        order: list[_Bucket] = []
        for bucket in first + self._buckets[::-1]:
            if all(bucket is not b for b in order):
                order.append(bucket)
        return order

    def _forward_pre_hook(self, module: torch.nn.Module, *unused: Any) -> None:
        for p in self._own_params.get(module, []) + self._params_read_outside_owner(module):
            self._finish_bucket_param_sync(self._bucket_of[id(p)])

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

    def zero_grad_buffer(self) -> None:
        """Clears every gradient (``param.grad`` to None, ``main_grad`` buffers to zero) and
        forgets the step's state, waiting first for any collective in flight."""
        for work, _ in self._works:
            work.wait()
        self._reset()
        for bucket in self._buckets:
            if bucket.grad_data is not None:
                bucket.grad_data.zero_()
            for p in bucket.params:
                p.grad = None
                if self._main_grads:
                    p.grad_added_to_main_grad = False

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.ready.clear()
        self._works = []
        self._next_launch = 0

    def extra_repr(self) -> str:
        mode = "reduce-scatter" if self._reduce_scatter else "all-reduce"
        return f"data_parallel_size={self._dp_size}, buckets={len(self._buckets)}, {mode}"
