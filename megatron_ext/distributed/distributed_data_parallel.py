"""A data-parallel wrapper whose gradient all-reduces overlap the backward pass.

Parameters are grouped into buckets. A hook on each parameter notes when its gradient for the
current backward is complete; once every parameter of a bucket is complete, the bucket's
all-reduce starts asynchronously while autograd goes on computing the gradients of earlier
layers. ``finish_grad_sync()`` (called by ``finalize_model_grads``) starts what is left, waits,
and writes the averaged gradients back into ``param.grad``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_ext import parallel_state

DEFAULT_BUCKET_SIZE_BYTES = 40 * 1024 * 1024


@dataclass
class _Bucket:
    """Parameters whose gradients travel in one flat all-reduce."""

    index: int
    dtype: torch.dtype
    device: torch.device
    element_size: int
    params: list[torch.nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    numel: int = 0
    # Per-step state: ids of the parameters whose gradient is complete.
    ready: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)


class DistributedDataParallel(torch.nn.Module):
    """Averages gradients over a data-parallel group, overlapping the reduction with backward.

    ``module`` is kept as ``self.module``; ``forward`` calls it. The pipeline schedules and
    ``finalize_model_grads`` look through ``.module`` for ``config``, ``set_input_tensor`` and
    the shared embedding weight.

    Buckets hold parameters of one dtype and device, taken in reverse registration order (close
    to the order in which backward produces their gradients), up to ``bucket_size_bytes`` each (a
    larger parameter gets a bucket of its own). A bucket's all-reduce starts as soon as all its
    gradients are complete and every earlier bucket has started: buckets start strictly in index
    order, so every rank issues the same collectives in the same order whatever order its hooks
    fire in.

    Usage per step: run the backward(s) with all but the last inside ``no_sync()`` (the schedules
    do this through ``config.no_sync_func = ddp.no_sync``), then ``finish_grad_sync()`` (which
    ``finalize_model_grads`` calls), then the optimizer step. Clear gradients with the optimizer's
    ``zero_grad()`` (either ``set_to_none`` setting works) or with ``zero_grad_buffer()``.

    After ``finish_grad_sync()`` every trainable parameter has a gradient: a parameter that got
    none on this rank contributes zeros, so all ranks reduce the same buffers and a parameter
    used only on some ranks gets the correct average.

    The reduction is a SUM followed by a division by the group size (gloo has no AVG), in the
    same arithmetic as ``allreduce_gradients``. With a group of one rank nothing is registered
    and ``finish_grad_sync()`` does nothing.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        data_parallel_group: dist.ProcessGroup | None = None,
        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(bucket_size_bytes, bool) or not isinstance(bucket_size_bytes, int) or bucket_size_bytes < 1:
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
            data_parallel_group = (
                parallel_state.get_data_parallel_group()
                if parallel_state.model_parallel_is_initialized()
                else dist.group.WORLD
            )
        self.module = module
        self.data_parallel_group = data_parallel_group
        self.bucket_size_bytes = bucket_size_bytes
        self._dp_size = dist.get_world_size(data_parallel_group)
        self._buckets = self._make_buckets(named, bucket_size_bytes)
        self._bucket_of: dict[int, _Bucket] = {id(p): b for b in self._buckets for p in b.params}
        self._sync_enabled = True
        self._next_launch = 0  # buckets [0, _next_launch) have started this step
        self._works: list[tuple[Any, torch.Tensor]] = []
        self._hook_handles: list[Any] = []
        if self._dp_size > 1:
            for _, p in named:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @staticmethod
    def _make_buckets(named: list[tuple[str, torch.nn.Parameter]], limit: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_bucket: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        for name, p in reversed(named):
            key = (p.dtype, p.device)
            bucket = open_bucket.get(key)
            size = p.numel() * p.element_size()
            if bucket is None or (bucket.params and bucket.nbytes + size > limit):
                bucket = _Bucket(
                    index=len(buckets), dtype=p.dtype, device=p.device, element_size=p.element_size()
                )
                buckets.append(bucket)
                open_bucket[key] = bucket
            bucket.params.append(p)
            bucket.names.append(name)
            bucket.numel += p.numel()
        return buckets

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # Introspection --------------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """The parameter names of each bucket, in launch order."""
        return tuple(tuple(b.names) for b in self._buckets)

    @property
    def launched_buckets(self) -> int:
        """How many buckets' all-reduces have started since the last ``finish_grad_sync()``."""
        return self._next_launch

    # Gradient synchronisation ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside this context only accumulate into ``param.grad``; nothing is reduced
        until a backward outside it (or ``finish_grad_sync()``)."""
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
        if not self._sync_enabled:
            return
        bucket.ready.add(id(param))
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].is_ready():
            self._launch(self._buckets[self._next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        # A flat copy: the reduction runs while autograd keeps writing other gradients.
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        offset = 0
        for p in bucket.params:
            chunk = flat[offset : offset + p.numel()]
            if p.grad is None:
                chunk.zero_()  # every rank must reduce the same buffers
            else:
                chunk.copy_(p.grad.reshape(-1))
            offset += p.numel()
        work = dist.all_reduce(flat, group=self.data_parallel_group, async_op=True)
        self._works.append((work, flat))
        self._next_launch += 1

    def finish_grad_sync(self) -> None:
        """Starts the buckets not yet started (in index order), waits for every all-reduce,
        and writes the averages into ``param.grad``. Resets the per-step state."""
        if self._dp_size == 1:
            self._reset()
            return
        try:
            while self._next_launch < len(self._buckets):
                self._launch(self._buckets[self._next_launch])
            for bucket, (work, flat) in zip(self._buckets, self._works):
                work.wait()
                flat.div_(self._dp_size)
                offset = 0
                for p in bucket.params:
                    value = flat[offset : offset + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = value.clone()
                    else:
                        p.grad.copy_(value)
                    offset += p.numel()
        finally:
            self._reset()

    def zero_grad_buffer(self) -> None:
        """Sets every gradient to None and forgets the step's state (waiting first for any
        all-reduce in flight, so none is abandoned half-way). Equivalent to the optimizer's
        ``zero_grad()`` after a completed ``finish_grad_sync()``."""
        for work, _ in self._works:
            work.wait()
        self._reset()
        for bucket in self._buckets:
            for p in bucket.params:
                p.grad = None

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.ready.clear()
        self._works = []
        self._next_launch = 0

    def extra_repr(self) -> str:
        return f"data_parallel_size={self._dp_size}, buckets={len(self._buckets)}"
