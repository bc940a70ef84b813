"""Megatron-core's gradient buffers, buckets and bucket groups
(``megatron.core.distributed.param_and_grad_buffer``).

A ``_ParamAndGradBuffer`` holds the gradients of the parameters of one (parameter dtype, gradient
dtype) pair in one flat ``grad_data`` tensor; ``param.main_grad`` is a view into it. The parameters
are laid out in reverse order (roughly the order in which backward produces their gradients) and cut
into buckets: a bucket closes as soon as it holds ``bucket_size`` elements or more (``None``: one
bucket). Under the distributed optimizer every parameter starts at a multiple of 64 elements, every
bucket ends at a multiple of lcm(dp, 128) (so it splits into dp equal slices), and a
``shared_embedding`` parameter gets a bucket of its own (the first and last pipeline stage then slice
it alike). ``bucket.numel_unpadded`` counts a bucket's elements up to its last parameter (padding
between parameters included), ``bucket.grad_data`` is the padded bucket.

A ``_ParamAndGradBucketGroup`` (one bucket, as in Megatron-core without fp8 parameters) reduces its
buckets over the data-parallel group: scaled by ``gradient_scaling_factor`` (1/dp, or 1 with
``average_in_collective`` or a per-token loss), then all-reduced, or reduce-scattered under the
distributed optimizer (rank r keeps the r-th slice; ``reduce_scatter_with_fp32_accumulation`` sums
16-bit slices in float32). With ``num_distributed_optimizer_instances`` > 1 the slice is then
all-reduced over the other instances. gloo has no AVG: ``average_in_collective`` is a SUM followed by
a division of what the collective wrote.

Readiness follows Megatron-core: ``register_grad_ready(param)`` counts the gradients each parameter
receives in the last micro-batch of a step. In the first step the counts are only recorded (nothing
starts during that backward; ``finish_grad_sync`` starts it); from then on a group's collective
starts as soon as its counts equal the first step's. Misuse that Megatron-core asserts against raises
``GradSyncError``, a RuntimeError that is also an AssertionError.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ext._torch_compat import all_gather_single, reduce_scatter_single
from megatron_ext.comm_errors import ReportedWork, reported
from megatron_ext.distributed.reduce_scatter_with_fp32_accumulation import (
    reduce_scatter_with_fp32_accumulation,
)

# Module attributes, as in Megatron-core, so that they can be patched (tests do).
dist_all_gather_func = all_gather_single
dist_reduce_scatter_func = reduce_scatter_single


# The 16-bit parameter dtypes: their gradients may be reduced in float32 and the optimizer keeps
# float32 main copies of them.
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def model_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient lives: ``main_grad`` (a view into a buffer here, Megatron-core's
    convention) if the parameter has one, else ``param.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class GradSyncError(RuntimeError, AssertionError):
    """Gradient synchronisation used out of order: a collective asked for twice, waited for before
    it started, or ``register_grad_ready`` without ``overlap_grad_reduce``. Megatron-core asserts in
    these places, hence also an AssertionError."""


# A buffer freed and given back (FullyShardedDataParallel's gathered parameters and full
# gradients): the tensor and its views keep their shapes, only the storage goes.
def free(tensor: torch.Tensor) -> None:
    """Drops ``tensor``'s storage; the tensor (and its views) keep their shapes."""
    tensor.untyped_storage().resize_(0)


def allocate(tensor: torch.Tensor) -> bool:
    """Gives ``tensor`` its storage back; True if it had none (its values are then undefined)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 and tensor.numel() > 0:
        storage.resize_(tensor.numel() * tensor.element_size())
        return True
    return False


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0 or tensor.untyped_storage().nbytes() > 0


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> list[torch.Tensor]:
    """``buffer`` cut into ``data_parallel_world_size`` equal views."""
    if buffer.numel() % data_parallel_world_size != 0:
        raise ValueError(
            f"shard_buffer: {buffer.numel()} elements do not split into "
            f"{data_parallel_world_size} equal shards"
        )
    size = buffer.numel() // data_parallel_world_size
    return [buffer[r * size : (r + 1) * size] for r in range(data_parallel_world_size)]


def _pad(number: int, divisor: int) -> int:
    return -(-number // divisor) * divisor


def _reported_work(work: Any, what: str, group: dist.ProcessGroup, tensor: torch.Tensor) -> Any:
    return None if work is None else ReportedWork(work, what, group, tensor=tensor)


class _ParamAndGradBucket:
    """Parameters whose gradients travel in one collective: ``grad_data`` is the bucket's view of
    its buffer (padded), ``offset`` where it starts there, ``param_to_index[p]`` the ``[start, end)``
    of ``p``'s gradient within the bucket, ``params_list`` the parameters in buffer order."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        param_data: torch.Tensor | None,
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
        param_to_index: dict[torch.nn.Parameter, tuple[int, int]] | None = None,
        names: list[str] | None = None,
    ) -> None:
        self.params_list = list(params)
        self.params = set(params)
        if len(self.params) != len(self.params_list):
            raise ValueError("a bucket cannot hold the same parameter twice")
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        if param_to_index is None:  # packed one after the other
            param_to_index, start = {}, 0
            for p in self.params_list:
                param_to_index[p] = (start, start + p.numel())
                start += p.numel()
        self.param_to_index = param_to_index
        self.names = list(names) if names is not None else [""] * len(self.params_list)
        # The distributed optimizer's parameter all-gather in flight: (work, gathered buffer).
        self.param_gather: tuple[Any, torch.Tensor] | None = None

    def describe(self) -> str:
        """For a failed collective's message: ``bucket 0 (3 parameters, 'a' ... 'c')``."""
        names = [n or "?" for n in self.names]
        if len(names) == 1:
            return f"bucket {self.bucket_id} (1 parameter, {names[0]!r})"
        return f"bucket {self.bucket_id} ({len(names)} parameters, {names[0]!r} ... {names[-1]!r})"

    @property
    def offsets(self) -> list[int]:
        """Where each parameter of ``params_list`` starts within the bucket."""
        return [self.param_to_index[p][0] for p in self.params_list]

    @property
    def padded_numel(self) -> int:
        return self.grad_data.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.grad_data.dtype

    @property
    def device(self) -> torch.device:
        return self.grad_data.device


class _ParamAndGradBuffer:
    """One flat gradient buffer for the parameters of one (param dtype, grad dtype) pair, cut into
    buckets (see the module docstring for the layout)."""

    def __init__(
        self,
        ddp_config: Any,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: list[torch.nn.Parameter],
        data_parallel_group: dist.ProcessGroup,
        bucket_size: int | None,
        param_to_name: dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
        param_indices: list[int] | None = None,
        nccl_ub: bool = False,
        pg_collection: Any = None,
    ) -> None:
        if len(set(params)) != len(params):
            raise ValueError("_ParamAndGradBuffer: the same parameter is listed twice")
        if nccl_ub:
            raise NotImplementedError("NCCL user buffers (nccl_ub=True) are not supported by megatron_ext")
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = list(params)
        self.param_indices = param_indices if param_indices is not None else list(range(len(params)))
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        distributed = bool(getattr(ddp_config, "use_distributed_optimizer", False))

        def pad_param_start(index: int) -> int:
            return _pad(index, 64) if distributed else index

        def pad_bucket_end(index: int) -> int:
            if not distributed:
                return index
            divisor = math.lcm(self.data_parallel_world_size, 128)
            if getattr(ddp_config, "pad_buckets_for_high_nccl_busbw", False):
                divisor = math.lcm(divisor, 2**16)
            return _pad(index, divisor)

        def own_bucket(param: torch.nn.Parameter) -> bool:
            return distributed and bool(getattr(param, "shared_embedding", False))

        # Layout: where each parameter goes and where each bucket ends.
        self.param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] = {}
        self.bucket_indices: list[tuple[int, int]] = []
        numel_unpadded: list[int] = []
        bucket_start, start, in_bucket = 0, 0, 0

        def close_bucket(end: int) -> int:
            nonlocal bucket_start, in_bucket
            numel_unpadded.append(end - bucket_start)
            padded_end = pad_bucket_end(end)
            self.bucket_indices.append((bucket_start, padded_end))
            bucket_start, in_bucket = padded_end, 0
            return padded_end

        for param in self.params[::-1]:
            start = pad_param_start(start)
            if own_bucket(param) and in_bucket:
                start = close_bucket(start)
            end = start + param.numel()
            self.param_index_map[param] = (start, end, len(self.bucket_indices))
            in_bucket += 1
            full = bucket_size is not None and end - bucket_start >= bucket_size
            start = close_bucket(end) if full or own_bucket(param) else end
        if in_bucket:
            close_bucket(start)
        self.numel = self.bucket_indices[-1][1] if self.bucket_indices else 0
        self.numel_unpadded = sum(numel_unpadded)

        device = self.params[0].device if self.params else torch.device("cpu")
        # Under the distributed optimizer the parameters become views into one flat buffer laid
        # out as the gradients, so the all-gather of the updated slices writes straight into them
        # (no second copy of the parameters). Otherwise they keep their own storage.
        self.param_data: torch.Tensor | None = None
        if distributed:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
            with torch.no_grad():
                for param in self.params:
                    start, end, _ = self.param_index_map[param]
                    self.param_data[start:end].copy_(param.detach().reshape(-1))
                    param.data = self.param_data[start:end].view(param.shape)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)

        self.buckets: list[_ParamAndGradBucket] = []
        self.param_to_bucket: dict[torch.nn.Parameter, _ParamAndGradBucket] = {}
        for bucket_id, (lo, hi) in enumerate(self.bucket_indices):
            members = [p for p in self.params[::-1] if self.param_index_map[p][2] == bucket_id]
            bucket = _ParamAndGradBucket(
                params=members,
                param_data=None if self.param_data is None else self.param_data[lo:hi],
                grad_data=self.grad_data[lo:hi],
                offset=lo,
                numel_unpadded=numel_unpadded[bucket_id],
                gradient_scaling_factor=gradient_scaling_factor,
                bucket_id=bucket_id,
                param_to_index={
                    p: (self.param_index_map[p][0] - lo, self.param_index_map[p][1] - lo) for p in members
                },
                names=[param_to_name.get(p, "") for p in members],
            )
            self.buckets.append(bucket)
            for p in members:
                self.param_to_bucket[p] = bucket

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s gradient in the buffer, shaped like ``param`` (its ``main_grad``)."""
        start, end, _ = self.param_index_map[param]
        return self.grad_data[start:end].view(param.shape)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zeroes the gradients."""
        self.grad_data.zero_()


class _Works:
    """The handles of one bucket group's collectives, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


class _ParamAndGradBucketGroup:
    """Buckets whose collectives start together, once every parameter of the group is ready.

    ``collective_group`` is the data-parallel group (its distributed-optimizer instance part with
    ``num_distributed_optimizer_instances`` > 1). A ``DistributedDataParallel`` sets ``dispatch``: a
    group that becomes ready then asks the wrapper, which starts ready groups in one fixed order on
    every rank (gloo pairs collectives by the order they are issued)."""

    def __init__(
        self,
        buckets: list[_ParamAndGradBucket],
        ddp_config: Any,
        collective_group: dist.ProcessGroup,
        collective_group_size: int,
    ) -> None:
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.collective_group = collective_group
        self.collective_group_size = collective_group_size
        self.collective_group_rank = dist.get_rank(collective_group)
        if getattr(ddp_config, "use_distributed_optimizer", False):
            self.intra_distributed_optimizer_instance_group = collective_group
            self.intra_distributed_optimizer_instance_size = collective_group_size
            self.intra_distributed_optimizer_instance_rank = self.collective_group_rank
        else:
            self.data_parallel_group = collective_group
        self.inter_distributed_optimizer_instance_group: dist.ProcessGroup | None = None
        self.param_to_bucket = {p: b for b in buckets for p in b.params_list}
        self.params = set(self.param_to_bucket)
        self.next_param_gather_bucket_group: _ParamAndGradBucketGroup | None = None
        self.golden_per_param_grad_ready_counts: dict[torch.nn.Parameter, int] = {}
        self.per_param_grad_ready_counts: dict[torch.nn.Parameter, int] = {}
        self.is_last_microbatch = True
        self.is_first_batch = True
        self.grad_reduce_handle: _Works | None = None
        self.param_gather_handle = None
        self.param_gather_dispatched = False
        # Set by DistributedDataParallel: starts ready groups in order. Without it a ready group
        # starts itself.
        self.dispatch: Callable[[bool], None] | None = None
        # DistributedDataParallel without a ddp_config keeps gradients in param.grad: they are
        # copied into the bucket before the collective and the result copied back.
        self.grads_in_param_grad = False
        self._dispatched = False  # the collective was issued since the last finish / reset
        self._after_wait: list[Callable[[], None]] = []

    # Readiness -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Ends a step: in the first one, the gradient counts just seen become the ones to wait
        for. A collective still in flight is waited for."""
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
            self._after_wait = []
        if self.is_first_batch and self.per_param_grad_ready_counts:
            self.golden_per_param_grad_ready_counts = self.per_param_grad_ready_counts
            self.is_first_batch = False
        self.per_param_grad_ready_counts = {}
        self.is_last_microbatch = True
        self._dispatched = False

    @property
    def grad_reduce_dispatched(self) -> bool:
        """Whether this step's collective has been issued (and not yet finished)."""
        return self._dispatched

    def is_ready(self) -> bool:
        """Every parameter has had as many gradients in this step's last micro-batch as in the
        first step's (never true during the first step)."""
        counts, golden = self.per_param_grad_ready_counts, self.golden_per_param_grad_ready_counts
        return (
            not self.is_first_batch
            and not self._dispatched
            and len(counts) == len(golden)  # cheap first: the full comparison only at the end
            and counts == golden
        )

    def register_grad_ready(self, param: torch.nn.Parameter, force_all_reduce: bool = False) -> None:
        """Counts a gradient of ``param`` (in the last micro-batch only); starts the collective
        (through ``dispatch`` when set) once the group is ready."""
        if not getattr(self.ddp_config, "overlap_grad_reduce", False):
            raise GradSyncError(
                "register_grad_ready() should only be called when overlap_grad_reduce is True"
            )
        if not self.is_last_microbatch:
            return
        if param not in self.params:
            raise GradSyncError("register_grad_ready(): the parameter is not in this bucket group")
        self.per_param_grad_ready_counts[param] = self.per_param_grad_ready_counts.get(param, 0) + 1
        if self.is_ready():
            if self.dispatch is not None:
                self.dispatch(force_all_reduce)
            else:
                self.start_grad_sync(force_all_reduce)

    # Collectives -----------------------------------------------------------------------------

    def check_grads(self, check_for_nan_or_inf: bool, check_for_large: bool = False) -> None:
        if not check_for_nan_or_inf:
            return
        for bucket in self.buckets:
            if not bool(torch.isfinite(bucket.grad_data).all()):
                raise RuntimeError(
                    f"DistributedDataParallel: a gradient in bucket {bucket.bucket_id} "
                    f"({bucket.names[:3]}...) "
                    "is NaN or infinite before its data-parallel reduction (check_for_nan_in_grad)"
                )

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Issues the group's collective: asynchronous under ``overlap_grad_reduce`` (with one
        distributed-optimizer instance), else complete when this returns. ``force_all_reduce``
        all-reduces a distributed optimizer's buckets instead of reduce-scattering them."""
        if self._dispatched:
            if self.is_first_batch:
                return
            raise GradSyncError("Should not have multiple communication calls outstanding at once")
        config = self.ddp_config
        if self.grads_in_param_grad:
            for bucket in self.buckets:
                for p in bucket.params_list:
                    lo, hi = bucket.param_to_index[p]
                    view = bucket.grad_data[lo:hi]
                    view.zero_() if p.grad is None else view.copy_(p.grad.reshape(-1))
        self.check_grads(getattr(config, "check_for_nan_in_grad", False))
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data.mul_(bucket.gradient_scaling_factor)
        self._dispatched = True

        instances = getattr(config, "num_distributed_optimizer_instances", 1)
        async_op = bool(getattr(config, "overlap_grad_reduce", False)) and instances == 1
        reduce_scatter = bool(getattr(config, "use_distributed_optimizer", False)) and not force_all_reduce
        average = bool(getattr(config, "average_in_collective", False))
        works: list[Any] = []
        reduced: list[torch.Tensor] = []  # what the collectives write (divided under average)
        for bucket in self.buckets:
            if reduce_scatter:
                local = shard_buffer(bucket.grad_data, self.collective_group_size)[self.collective_group_rank]
                reduced.append(local)
                if self.collective_group_size > 1:
                    scatter = (
                        reduce_scatter_with_fp32_accumulation
                        if getattr(config, "reduce_scatter_with_fp32_accumulation", False)
                        else dist_reduce_scatter_func
                    )
                    what = f"reduce-scatter of the gradients of {bucket.describe()}"
                    with reported(what, self.collective_group, tensor=bucket.grad_data):
                        work = scatter(
                            local, bucket.grad_data, op=dist.ReduceOp.SUM, group=self.collective_group,
                            async_op=async_op,
                        )
                    works.append(_reported_work(work, what, self.collective_group, bucket.grad_data))
            else:
                reduced.append(bucket.grad_data)
                if self.collective_group_size > 1:
                    what = f"all-reduce of the gradients of {bucket.describe()}"
                    with reported(what, self.collective_group, tensor=bucket.grad_data):
                        work = torch.distributed.all_reduce(
                            bucket.grad_data, op=dist.ReduceOp.SUM, group=self.collective_group,
                            async_op=async_op,
                        )
                    works.append(_reported_work(work, what, self.collective_group, bucket.grad_data))
        after: list[Callable[[], None]] = []
        if average and self.collective_group_size > 1:
            after.append(lambda: [t.div_(self.collective_group_size) for t in reduced])
        inter = self.inter_distributed_optimizer_instance_group
        if inter is not None and dist.get_world_size(inter) > 1:
            # Several distributed-optimizer instances (synchronous): the all-reduce over the
            # instances reads what the collective within this instance wrote.
            for work in works:
                if work is not None:
                    work.wait()
            works = []
            for fn in after:
                fn()
            after = []
            for t in reduced:
                with reported(
                    "all-reduce of the gradients over the distributed-optimizer instances", inter, tensor=t
                ):
                    torch.distributed.all_reduce(t, op=dist.ReduceOp.SUM, group=inter)
                if average:
                    t.div_(dist.get_world_size(inter))
        if self.grads_in_param_grad:
            after.append(self._copy_back_to_param_grad)
        works = [w for w in works if w is not None]
        if async_op and works:
            self.grad_reduce_handle = _Works(works)
            self._after_wait = after
        else:
            for work in works:
                work.wait()
            for fn in after:
                fn()

    def _copy_back_to_param_grad(self) -> None:
        for bucket in self.buckets:
            for p in bucket.params_list:
                lo, hi = bucket.param_to_index[p]
                value = bucket.grad_data[lo:hi].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Completes the group's collective: without ``overlap_grad_reduce`` issues it now (and
        waits); with it, waits for the collective started when the group became ready (in the
        first step, starts it here). Raises ``GradSyncError`` when it never started."""
        self.param_gather_dispatched = False
        config = self.ddp_config
        if not getattr(config, "overlap_grad_reduce", False):
            self.start_grad_sync(force_all_reduce)
            self._dispatched = False
            return
        if self.is_first_batch and not self._dispatched:
            self.start_grad_sync(force_all_reduce)
        if getattr(config, "num_distributed_optimizer_instances", 1) > 1:
            # Synchronous there: done if it started (and Megatron-core waits for nothing else).
            self._dispatched = False
            return
        if not self._dispatched:
            raise GradSyncError(
                "Communication call has not been issued for this bucket "
                f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad available)"
            )
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        for fn in self._after_wait:
            fn()
        self._after_wait = []
        self._dispatched = False


def partition_buckets(
    buffers: list[_ParamAndGradBuffer], force_single_bucket_group: bool = False
) -> list[_ParamAndGradBucketGroup]:
    """Bucket groups over ``buffers``: one group per bucket, or one group holding every bucket with
    ``force_single_bucket_group`` (then all buffers must share config and group). Megatron-core's
    fp8 grouping has nothing to group here (no fp8 parameters)."""
    if not buffers:
        return []
    if force_single_bucket_group:
        first = buffers[0]
        for buffer in buffers[1:]:
            if buffer.data_parallel_group is not first.data_parallel_group:
                raise ValueError("partition_buckets: one bucket group needs one data-parallel group")
        buckets = [bucket for buffer in buffers for bucket in buffer.buckets]
        return [
            _ParamAndGradBucketGroup(
                buckets, first.ddp_config, first.data_parallel_group, first.data_parallel_world_size
            )
        ]
    return [
        _ParamAndGradBucketGroup(
            [bucket], buffer.ddp_config, buffer.data_parallel_group, buffer.data_parallel_world_size
        )
        for buffer in buffers
        for bucket in buffer.buckets
    ]
