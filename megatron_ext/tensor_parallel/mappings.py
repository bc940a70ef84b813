"""The conjugate communication regions of tensor and sequence parallelism.

Each function calls a C++ op (``torch.ops.megatron_ext.<name>``, declared with its kernels in
csrc/ops/mappings.cpp) whose autograd node does the conjugate collective in backward. Every op
takes ``(input, group_name, group_size, rank)``: what its result depends on is in its arguments, so
a compiled graph cached at one group size or rank is never reused at another. ``group=None`` means
the tensor-model-parallel group.

The input is never modified. An output may alias the input (the schemas say ``Tensor(a)``): at
group size 1 every region returns a view of its input, as does copy_to's forward and a first-dim
split of a contiguous input; Megatron-core returns the input itself there.

Adding a region: a row of the table in csrc/ops/mappings.cpp, a line in its registration block,
and here a function and its fake kernel (``_register_fake``).

=================================================  ========================  ==========================
region                                             forward                   backward
=================================================  ========================  ==========================
copy_to_tensor_model_parallel_region               identity                  all-reduce
reduce_from_tensor_model_parallel_region           all-reduce                identity
scatter_to_tensor_model_parallel_region            split last dim            all-gather last dim
gather_from_tensor_model_parallel_region           all-gather last dim       split last dim
scatter_to_sequence_parallel_region                split first dim           all-gather first dim
gather_from_sequence_parallel_region               all-gather first dim      reduce-scatter first dim
                                                                             (split when
                                                                             ``tensor_parallel_output_grad``
                                                                             is False)
reduce_scatter_to_sequence_parallel_region         reduce-scatter first dim  all-gather first dim
all_gather_last_dim_from_tensor_parallel_region    all-gather last dim       reduce-scatter last dim
reduce_scatter_last_dim_to_tensor_parallel_region  reduce-scatter last dim   all-gather last dim
=================================================  ========================  ==========================
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_ext import _C  # noqa: F401  (registers the ops)
from megatron_ext.parallel_state import ParallelStateError
from megatron_ext.tensor_parallel.utils import group_args, resolve_tp_group, tp_group_size_rank

_ops = torch.ops.megatron_ext


def resolve_group_name(group: dist.ProcessGroup | None) -> str:
    """The c10d registry name of ``group``; ``None`` means the tensor-model-parallel group."""
    return resolve_tp_group(group).group_name


def _check_tensor(input_: object, region: str) -> torch.Tensor:
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{region}: expected a torch.Tensor, got {type(input_).__name__}")
    return input_


# --- fake kernels: shapes and strides of the real kernels, from the schema's arguments only -------
# The conditions a fake's result rests on are ``torch._check``s; the argument errors are the C++
# op's own (its autograd kernel checks before dispatching, on fake tensors too).


def _fake_forward(kind: str, dim: int) -> Callable[..., torch.Tensor]:
    def fake(input_: torch.Tensor, group_name: str, group_size: int, rank: int) -> torch.Tensor:
        torch._check(0 <= rank < group_size, lambda: f"rank {rank} in a group of {group_size}")
        if kind == "identity" or group_size == 1:
            return torch.ops.aten.alias(input_)
        if kind == "all_reduce":
            return input_.new_empty(input_.shape)
        torch._check(input_.dim() > 0, lambda: "a tensor with at least one dimension")
        d = dim % input_.dim()
        if kind in ("split", "reduce_scatter"):
            torch._check(input_.shape[d] % group_size == 0, lambda: f"dim {d} divisible by {group_size}")
        if kind == "split":
            chunk = input_.shape[d] // group_size
            return input_.narrow(d, rank * chunk, chunk).contiguous()
        shape = list(input_.shape)
        shape[d] = shape[d] * group_size if kind == "all_gather" else shape[d] // group_size
        return input_.new_empty(shape)

    return fake


def _register_fake(name: str, kind: str, dim: int) -> None:
    torch.library.register_fake(f"megatron_ext::{name}")(_fake_forward(kind, dim))


# --- the regions --------------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: identity (a view of the input). Backward: all-reduce of the gradient."""
    _check_tensor(input_, "copy_to_tensor_model_parallel_region")
    return _ops.copy_to_tensor_model_parallel_region(input_, *group_args(group))


_register_fake("copy_to_tensor_model_parallel_region", "identity", -1)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-reduce into a new tensor (the input is not modified). Backward: identity."""
    _check_tensor(input_, "reduce_from_tensor_model_parallel_region")
    return _ops.reduce_from_tensor_model_parallel_region(input_, *group_args(group))


_register_fake("reduce_from_tensor_model_parallel_region", "all_reduce", -1)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: this rank's chunk of the last dim. Backward: all-gather along the last dim."""
    _check_tensor(input_, "scatter_to_tensor_model_parallel_region")
    return _ops.scatter_to_tensor_model_parallel_region(input_, *group_args(group))


_register_fake("scatter_to_tensor_model_parallel_region", "split", -1)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-gather along the last dim. Backward: this rank's chunk of the last dim."""
    _check_tensor(input_, "gather_from_tensor_model_parallel_region")
    return _ops.gather_from_tensor_model_parallel_region(input_, *group_args(group))


_register_fake("gather_from_tensor_model_parallel_region", "all_gather", -1)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: this rank's chunk of the first dim. Backward: all-gather along the first dim."""
    _check_tensor(input_, "scatter_to_sequence_parallel_region")
    return _ops.scatter_to_sequence_parallel_region(input_, *group_args(group))


_register_fake("scatter_to_sequence_parallel_region", "split", 0)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group=None,
    output_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Forward: all-gather along the first dim.

    Backward: reduce-scatter along the first dim when the consumer of the output is
    tensor-parallel (each rank holds a partial gradient), else this rank's chunk of it. With
    ``output_split_sizes``, rank r contributes ``output_split_sizes[r]`` rows.
    ``use_global_buffer`` is Megatron-core's allocation hint and changes nothing here.
    """
    _check_tensor(input_, "gather_from_sequence_parallel_region")
    if output_split_sizes is not None:
        return _GatherFromSequenceParallelRegion.apply(
            input_, group, tensor_parallel_output_grad, output_split_sizes, use_global_buffer
        )
    return _ops.gather_from_sequence_parallel_region(
        input_, bool(tensor_parallel_output_grad), *group_args(group)
    )


_gather_seq_fake = _fake_forward("all_gather", 0)


@torch.library.register_fake("megatron_ext::gather_from_sequence_parallel_region")
def _(input_, tensor_parallel_output_grad, group_name, group_size, rank):
    return _gather_seq_fake(input_, group_name, group_size, rank)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor,
    group=None,
    input_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """Forward: reduce-scatter along the first dim (rank r receiving ``input_split_sizes[r]`` rows
    when given). Backward: all-gather along the first dim."""
    _check_tensor(input_, "reduce_scatter_to_sequence_parallel_region")
    if input_split_sizes is not None:
        return _ReduceScatterToSequenceParallelRegion.apply(
            input_, group, input_split_sizes, use_global_buffer
        )
    return _ops.reduce_scatter_to_sequence_parallel_region(input_, *group_args(group))


_register_fake("reduce_scatter_to_sequence_parallel_region", "reduce_scatter", 0)


def all_gather_last_dim_from_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-gather along the last dim. Backward: reduce-scatter along the last dim."""
    _check_tensor(input_, "all_gather_last_dim_from_tensor_parallel_region")
    return _ops.all_gather_last_dim_from_tensor_parallel_region(input_, *group_args(group))


_register_fake("all_gather_last_dim_from_tensor_parallel_region", "all_gather", -1)


def reduce_scatter_last_dim_to_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: reduce-scatter along the last dim. Backward: all-gather along the last dim."""
    _check_tensor(input_, "reduce_scatter_last_dim_to_tensor_parallel_region")
    return _ops.reduce_scatter_last_dim_to_tensor_parallel_region(input_, *group_args(group))


_register_fake("reduce_scatter_last_dim_to_tensor_parallel_region", "reduce_scatter", -1)


# Megatron-core's region classes ------------------------------------------------------------
#
# Code written against Megatron-core calls ``_CopyToModelParallelRegion.apply(input_, group)`` and
# the like. Here the autograd nodes are C++ (the functions above), so these classes are not
# torch.autograd.Function subclasses: their static ``apply`` takes Megatron-core's arguments in its
# order and calls the C++ op. Uneven first-dim splits (``output_split_sizes`` /
# ``input_split_sizes``, used by expert routing) run as the C++ all-to-all op
# (csrc/ops/all_to_all.cpp), whose autograd node is C++ as well.
#
# Megatron-core's ``symbolic(graph, ...)`` and ``backward(ctx, grad_output)`` are kept for code that
# calls them directly: ``symbolic`` returns what ``apply`` returns; ``backward`` runs the conjugate
# region on ``grad_output`` (reading the group and options from ``ctx`` under Megatron-core's
# attribute names) and returns it with a None for each other argument of ``apply``.


class _RegionClass:
    """``symbolic`` for the region classes: the forward's value, as Megatron-core's tracing hook."""

    @classmethod
    def symbolic(cls, graph, *args, **kwargs) -> torch.Tensor:
        return cls.apply(*args, **kwargs)


def _all_to_all_autograd(
    input_: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The C++ all-to-all op along dim 0 (its autograd node's backward is the reverse exchange)."""
    return _ops.all_to_all(
        input_,
        None if output_split_sizes is None else [int(s) for s in output_split_sizes],
        None if input_split_sizes is None else [int(s) for s in input_split_sizes],
        group.group_name,
        group.size(),
        group.rank(),
    )


@torch.library.register_fake("megatron_ext::all_to_all")
def _(input_, output_split_sizes, input_split_sizes, group_name, group_size, rank):
    torch._check(0 <= rank < group_size, lambda: f"rank {rank} in a group of {group_size}")
    if group_size == 1:
        return torch.ops.aten.alias(input_)
    rows = sum(output_split_sizes) if output_split_sizes is not None else input_.shape[0]
    return input_.new_empty((rows, *input_.shape[1:]))


def _check_split_sizes(what: str, sizes: list[int], world: int) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(
            f"{what} must list {world} non-negative sizes (one per rank of the group), got {sizes}"
        )
    return sizes


class _CopyToModelParallelRegion(_RegionClass):
    """Forward: identity. Backward: all-reduce."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return copy_to_tensor_model_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return reduce_from_tensor_model_parallel_region(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(_RegionClass):
    """Forward: all-reduce. Backward: identity."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return grad_output, None


class _ScatterToModelParallelRegion(_RegionClass):
    """Forward: this rank's chunk of the last dim. Backward: all-gather along the last dim."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return scatter_to_tensor_model_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return gather_from_tensor_model_parallel_region(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(_RegionClass):
    """Forward: all-gather along the last dim. Backward: this rank's chunk of the last dim."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return gather_from_tensor_model_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return scatter_to_tensor_model_parallel_region(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(_RegionClass):
    """Forward: this rank's chunk of the first dim. Backward: all-gather along the first dim."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return scatter_to_sequence_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return gather_from_sequence_parallel_region(grad_output, True, ctx.group), None


class _GatherFromSequenceParallelRegion(_RegionClass):
    """Forward: all-gather along the first dim (rank r contributing ``output_split_sizes[r]`` rows
    when given). Backward: reduce-scatter along the first dim, or this rank's chunk when
    ``tensor_parallel_output_grad`` is False. ``use_global_buffer`` is an allocation hint of
    Megatron-core's and changes nothing here."""

    @staticmethod
    def apply(
        input_: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        tensor_parallel_output_grad: bool = True,
        output_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if output_split_sizes is None:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad, group)
        if not tensor_parallel_output_grad:
            raise ParallelStateError(
                "output_split_sizes needs tensor_parallel_output_grad=True (as in Megatron-core)"
            )
        group, world, rank = tp_group_size_rank(group)
        sizes = _check_split_sizes("output_split_sizes", output_split_sizes, world)
        if input_.shape[0] != sizes[rank]:
            raise ValueError(
                f"output_split_sizes[{rank}] = {sizes[rank]} but this rank's input has {input_.shape[0]} rows"
            )
        if world == 1:
            return input_
        # Every rank sends its whole input to every rank; the backward of the repeat sums the
        # returned gradient pieces, which is the reduce-scatter.
        repeated = input_.repeat(world, *([1] * (input_.dim() - 1)))
        return _all_to_all_autograd(repeated, sizes, [input_.shape[0]] * world, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        if ctx.tensor_parallel_output_grad:
            grad = _ReduceScatterToSequenceParallelRegion.apply(
                grad_output, ctx.group, ctx.output_split_sizes, ctx.use_global_buffer
            )
        else:
            if ctx.output_split_sizes is not None:
                raise ParallelStateError(
                    "output_split_sizes needs tensor_parallel_output_grad=True (as in Megatron-core)"
                )
            grad = scatter_to_sequence_parallel_region(grad_output, ctx.group)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(_RegionClass):
    """Forward: reduce-scatter along the first dim (rank r receiving ``input_split_sizes[r]`` rows
    when given). Backward: all-gather along the first dim."""

    @staticmethod
    def apply(
        input_: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        input_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if input_split_sizes is None:
            return reduce_scatter_to_sequence_parallel_region(input_, group)
        group, world, rank = tp_group_size_rank(group)
        sizes = _check_split_sizes("input_split_sizes", input_split_sizes, world)
        if input_.shape[0] != sum(sizes):
            raise ValueError(
                f"input_split_sizes {sizes} sum to {sum(sizes)}, but the input has {input_.shape[0]} rows"
            )
        if world == 1:
            return input_
        pieces = _all_to_all_autograd(input_, [sizes[rank]] * world, sizes, group)
        return pieces.view(world, sizes[rank], *input_.shape[1:]).sum(dim=0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        grad = _GatherFromSequenceParallelRegion.apply(
            grad_output, ctx.group, True, ctx.input_split_sizes, ctx.use_global_buffer
        )
        return grad, None, None, None


class _AllGatherFromTensorParallelRegion(_RegionClass):
    """Forward: all-gather along the last dim. Backward: reduce-scatter along the last dim."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return all_gather_last_dim_from_tensor_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return reduce_scatter_last_dim_to_tensor_parallel_region(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(_RegionClass):
    """Forward: reduce-scatter along the last dim. Backward: all-gather along the last dim."""

    @staticmethod
    def apply(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        return reduce_scatter_last_dim_to_tensor_parallel_region(input_, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        return all_gather_last_dim_from_tensor_parallel_region(grad_output, ctx.group), None


class _AllToAll(_RegionClass):
    """All-to-all along the first dim (equal chunks, or ``input_split_sizes`` rows to each rank
    and ``output_split_sizes`` rows from each). Backward: the reverse all-to-all."""

    @staticmethod
    def apply(
        group: dist.ProcessGroup,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
    ) -> torch.Tensor:
        _check_tensor(input, "all_to_all")
        if group.size() == 1:
            return input
        return _all_to_all_autograd(input, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple:
        grad = _AllToAll.apply(ctx.group, grad_output, ctx.input_split_sizes, ctx.output_split_sizes)
        return None, grad, None, None


def all_to_all(
    group: dist.ProcessGroup,
    input_: torch.Tensor,
    output_split_sizes_: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """All-to-all along the first dim over ``group`` (required, as in Megatron-core)."""
    if group is None:
        raise ParallelStateError("all_to_all: group should not be None")
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[tokens/tp, H]`` split along the sequence -> ``[tokens, H/tp]`` split along the hidden dim."""
    group = resolve_tp_group(group)
    world = group.size()
    input_ = input_.reshape(-1, input_.shape[-1])
    if input_.shape[-1] % world != 0:
        raise ValueError(f"all_to_all_sp2hp: the hidden size {input_.shape[-1]} is not divisible by {world}")
    chunks = torch.split(input_, input_.shape[-1] // world, dim=1)
    return all_to_all(group, torch.cat(chunks, dim=0))


def all_to_all_hp2sp(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``[tokens, H/tp]`` split along the hidden dim -> ``[tokens/tp, H]`` split along the sequence."""
    group = resolve_tp_group(group)
    world = group.size()
    input_ = input_.reshape(-1, input_.shape[-1])
    exchanged = all_to_all(group, input_)
    exchanged = exchanged.reshape(-1, exchanged.shape[-1])
    return torch.cat(torch.split(exchanged, exchanged.shape[0] // world, dim=0), dim=-1)
