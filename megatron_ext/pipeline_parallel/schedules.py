"""Forward-backward schedules over micro-batches: no pipelining, GPipe, 1F1B, interleaved 1F1B,
ZB-H1 and ZB-V.

Every schedule is called with Megatron-core's keywords::

    losses = forward_backward_func(
        forward_step_func=forward_step, data_iterator=it, model=model,
        num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False)

The contract, as in Megatron-core:

- ``model`` is a ``torch.nn.Module`` (or a list holding one; with a virtual pipeline a list of
  ``v`` model chunks, chunk ``c`` of pipeline rank ``r`` being virtual stage ``c * pp + r``) with
  a ``config`` attribute (a ``ModelParallelConfig`` or any object with its fields; wrappers
  exposing ``.module`` are looked through). With more than one stage it needs
  ``set_input_tensor(tensors)``: before each forward the schedule calls it with a list holding the
  activation received from the previous stage (a leaf tensor that requires grad), or ``[None]`` on
  the first stage, as Megatron-core does.
- ``forward_step_func(data_iterator, model)`` runs one model chunk's forward on one micro-batch and
  returns ``(output_tensor, loss_func)``. Except on the last stage, ``output_tensor`` is the
  ``[s, b, h]`` activation sent on (``s // tp`` under sequence parallelism, dtype
  ``config.pipeline_dtype``). The interleaved schedule takes one data iterator per chunk.
- On the last stage the schedule calls ``loss_func(output_tensor)``, which returns
  ``(loss, reduced)`` or ``(loss, num_tokens, reduced)``. The schedule divides ``loss`` by
  ``num_microbatches`` (and, for the 3-tuple, first by ``num_tokens`` unless
  ``config.calculate_per_token_loss``), runs the backward from it, and collects ``reduced``.
  With ``collect_non_loss_data=True`` (forward only) it collects
  ``loss_func(output_tensor, non_loss_data=True)`` instead.
- The schedule returns the collected values, one per micro-batch, on the last stage and ``[]``
  on the others. Parameter gradients accumulate over the micro-batches into ``.grad``; then
  ``config.finalize_model_grads_func(model_chunks)`` runs if set (with the total number of tokens
  as a second argument under ``calculate_per_token_loss``).

``config.no_sync_func`` (a context-manager factory, or one per chunk) is entered for every
backward but the last of each chunk, so a data-parallel wrapper reduces gradients once.
With ``config.grad_sync_func`` (one callable or one per chunk) every backward runs inside no_sync
and ``grad_sync_func[c](chunk.parameters())`` is called after chunk c's last backward; with model
chunks, ``config.param_sync_func[c](chunk.parameters())`` is called before chunk c's first forward
(neither in forward-only runs). ``config.grad_scale_func`` scales the loss before its backward;
``config.deallocate_pipeline_outputs`` frees each sent activation's data, keeping only its graph.

How the schedules are built: each is one ordered table per pipeline rank of typed actions
(``schedule_tables``: ``F``, ``B``, and a backward split into ``I`` and ``W``), run by one runner
(``run_schedule``). The runner places every rank's actions on a common clock (``plan_schedule``),
each at the first tick where its inputs exist, and exchanges what each tick produced with its
neighbours. Every rank computes every rank's table, so each knows what its neighbours send at
each tick: sends and receives always pair up, with no deadlock, on gloo and NCCL. A new schedule
is a new table (a builder in ``_SCHEDULE_REGISTRY``). The zero-bubble schedules (``zb-h1``,
``zb-v``) split each backward with ``split_backward``.

The package's four files: this one (the public entry points and the registry of schedule name to
table builder), ``microbatch_step`` (one micro-batch's forward and backward), ``runner`` (one
rank's table run against its neighbours', its options a ``RunOptions``) and ``megatron_helpers``
(Megatron-core's helpers its training loop calls). Every name Megatron-core's
``pipeline_parallel.schedules`` defines is importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import torch

from megatron_ext import parallel_state  # noqa: F401  (Megatron-core's schedules module has it)
from megatron_ext.pipeline_parallel.megatron_helpers import (  # noqa: F401  (Megatron-core's names)
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
    get_model_config,
    get_pp_rank_microbatches,
    get_tensor_shapes,
)
from megatron_ext.pipeline_parallel.microbatch_step import (  # noqa: F401  (Megatron-core's names)
    ForwardStepFunc,
    backward_step,
    check_first_val_step,
    custom_backward,
    deallocate_output_tensor,
    forward_step,
    forward_step_calc_loss,
    set_current_microbatch,
)
from megatron_ext.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_ext.pipeline_parallel.runner import RunOptions, _finalize, run_schedule
from megatron_ext.pipeline_parallel.schedule_tables import (  # noqa: F401  (re-exported)
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    ActionKind,
    ScheduleEntry,
    format_pipeline_order,
    get_schedule_table,
    gpipe_table,
    interleaved_table,
    no_pipelining_table,
    one_f_one_b_table,
    plan_schedule,
    schedule_table,
    stage_location,
    virtual_stage,
    zbv_table,
    zero_bubble_h1_table,
    _require_positive_int,
)
from megatron_ext.pipeline_parallel.microbatch_step import _timed
from megatron_ext.process_groups_config import ProcessGroupCollection, resolve_pg_collection
from megatron_ext.resolve import get_attr_wrapped_model, group_size
from megatron_ext.split_backward import backward_input, backward_weight  # noqa: F401  (re-exported)

Shape = Union[list[int], torch.Size]


# The registry: each pipelined schedule's tables, how many model chunks it runs, their layout ---


def _interleaved_tables(
    num_microbatches: int, num_chunks: int, pp_size: int, config: Any, forward_only: bool
) -> list[list[Action]]:
    group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp_size
    if group > num_microbatches or group < pp_size:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage {group} must lie in [pipeline size "
            f"{pp_size}, num_microbatches {num_microbatches}]"
        )
    remainder = num_microbatches % group
    if 0 < remainder < pp_size:
        raise RuntimeError(
            f"num_microbatches {num_microbatches} leaves a last group of {remainder} "
            f"micro-batches (groups of microbatch_group_size_per_vp_stage {group}): it must be "
            f"0 or at least the pipeline size {pp_size}, else the pipeline stalls"
        )
    return [interleaved_table(num_microbatches, num_chunks, group, pp_size, r, forward_only)
            for r in range(pp_size)]


def _gpipe_tables(
    num_microbatches: int, num_chunks: int, pp_size: int, config: Any, forward_only: bool
) -> list[list[Action]]:
    group = getattr(config, "microbatch_group_size_per_vp_stage", None)
    return [gpipe_table(num_microbatches, forward_only, num_chunks, group)] * pp_size


def _per_rank(table: Callable[..., list[Action]]) -> Callable[..., list[list[Action]]]:
    """The builder of a schedule with one chunk per rank: ``table(m, pp, rank, forward_only)`` of
    every rank."""

    def build(num_microbatches: int, num_chunks: int, pp_size: int, config: Any, forward_only: bool):
        return [table(num_microbatches, pp_size, r, forward_only) for r in range(pp_size)]

    return build


@dataclass(frozen=True)
class _Schedule:
    """A pipelined schedule: ``build_tables(m, num_chunks, pp, config, forward_only)`` gives every
    rank's table; ``chunks``: ``"one"`` model chunk per rank, ``"many"`` (a list or one) or
    ``"list"`` (one per virtual stage, with one data iterator each); ``layout`` of the chunks."""

    build_tables: Callable[..., list[list[Action]]]
    chunks: str = "one"
    layout: str = "interleaved"


_SCHEDULE_REGISTRY: dict[str, _Schedule] = {
    "1f1b": _Schedule(_per_rank(one_f_one_b_table)),
    "gpipe": _Schedule(_gpipe_tables, chunks="many"),
    "interleaved": _Schedule(_interleaved_tables, chunks="list"),
    "zb-h1": _Schedule(_per_rank(zero_bubble_h1_table)),
    "zb-v": _Schedule(_per_rank(zbv_table), chunks="list", layout="v"),
}
SCHEDULES = tuple(sorted([*_SCHEDULE_REGISTRY, "no_pipelining"]))


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, *, schedule: str | None = None
) -> Callable[..., list]:
    """The schedule to run, as Megatron-core chooses it.

    With neither ``pp_size`` nor ``vp_size`` both come from parallel_state; otherwise the given
    values are used as they are (None meaning no virtual pipeline). One stage:
    ``forward_backward_no_pipelining``; several: ``forward_backward_pipelining_with_interleaving``
    with a virtual pipeline size, else ``forward_backward_pipelining_without_interleaving`` (1F1B).

    ``schedule`` (keyword, not in Megatron-core) picks one by name: ``"1f1b"``, ``"gpipe"``
    (``forward_backward_pipelining_gpipe``), ``"interleaved"``, ``"no_pipelining"``, ``"zb-h1"``
    (``forward_backward_pipelining_zero_bubble_h1``) or ``"zb-v"``
    (``forward_backward_pipelining_zbv``).
    """
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or None, got {schedule!r}")
    if pp_size is None and vp_size is None:
        _require_initialized()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if schedule == "no_pipelining" and pp_size != 1:
        raise ValueError(f"schedule 'no_pipelining' needs pipeline_model_parallel_size 1, got {pp_size}")
    if schedule is None:
        if pp_size == 1:
            schedule = "no_pipelining"
        elif vp_size is None:
            schedule = "1f1b"
        else:
            schedule = "zb-v" if parallel_state.get_pipeline_model_parallel_layout() == "v" else "interleaved"
    return _SCHEDULE_FUNCTIONS[schedule]


# Set-up shared by the schedules ------------------------------------------------------------


def _require_initialized() -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "the pipeline schedules need the model-parallel groups: call "
            "megatron_ext.parallel_state.initialize_model_parallel() first"
        )


def _as_chunks(name: str, value: Any, many: bool, need_list: bool = False) -> list:
    if isinstance(value, list):
        if not many and len(value) != 1:
            raise ValueError(
                f"{name} is a list of {len(value)} model chunks: this schedule runs one chunk per "
                "stage; use forward_backward_pipelining_with_interleaving"
            )
        if not value:
            raise ValueError(f"{name} is an empty list")
        return value
    if need_list:
        raise ValueError(f"the interleaved schedule needs {name} as a list, one per model chunk")
    return [value]


# The groups the schedules read from a pg_collection; one stage without p2p needs no embedding groups.
_SCHEDULE_GROUPS = ("tp", "cp", "embd", "pos_embd", "pp", "dp_cp")
_ONE_STAGE_GROUPS = ("tp", "cp", "pp", "dp_cp")


def _groups(
    p2p_communicator: P2PCommunicator | None, pg_collection: ProcessGroupCollection | None, config: Any
) -> tuple[P2PCommunicator, ProcessGroupCollection]:
    """Megatron-core's rule: neither (use parallel_state's groups) or both."""
    if (p2p_communicator is None) != (pg_collection is None):
        raise ValueError(
            "Invalid combination of p2p_communicator, pg_collection: provide none (the groups of "
            "parallel_state) or both"
        )
    pg_collection = resolve_pg_collection(pg_collection, _SCHEDULE_GROUPS, "the pipeline schedule")
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pg_collection.pp, config)
    return p2p_communicator, pg_collection


def _config_of(model: torch.nn.Module) -> Any:
    try:
        config = get_model_config(model)
    except AttributeError:
        raise AttributeError(
            f"the model ({type(model).__name__}) has no 'config' attribute: the schedules read "
            "the ModelParallelConfig from model.config"
        ) from None
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("config.defer_embedding_wgrad_compute=True is not supported: the output layer "
                         "computes its weight gradient in its own backward (set it to False)")
    return config


def _common_checks(num_microbatches: int, forward_only: bool, collect_non_loss_data: bool) -> None:
    _require_positive_int("num_microbatches", num_microbatches)
    if collect_non_loss_data and not forward_only:
        raise ValueError("collect_non_loss_data=True needs forward_only=True: there is no loss to "
                         "run the backward from")


def _tensor_shape(
    seq_length: int, micro_batch_size: int, config: Any, pgs: ProcessGroupCollection,
    decoder_seq_length: int | None = None,
) -> tuple[int, int, int]:
    """Checks the shape arguments on every rank alike (before anyone communicates). The stages
    exchange ``decoder_seq_length`` positions when it is given, as in Megatron-core."""
    _require_positive_int("seq_length", seq_length)
    _require_positive_int("micro_batch_size", micro_batch_size)
    _require_positive_int("config.hidden_size", getattr(config, "hidden_size", None))
    name, length = "seq_length", seq_length
    if decoder_seq_length is not None:
        _require_positive_int("decoder_seq_length", decoder_seq_length)
        name, length = "decoder_seq_length", decoder_seq_length
    cp_size, tp_size = group_size(pgs.cp), group_size(pgs.tp)
    if length % cp_size != 0:
        raise ValueError(f"{name} {length} is not divisible by the context-parallel size {cp_size}")
    if getattr(config, "sequence_parallel", False) and (length // cp_size) % tp_size != 0:
        raise ValueError(
            f"{name} {length}" + (f" / context-parallel size {cp_size}" if cp_size > 1 else "")
            + f" is not divisible by the tensor-parallel size {tp_size} (needed under sequence_parallel)"
        )
    return get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        config=config, tp_group=pgs.tp, cp_group=pgs.cp,
    )[0]


# The schedules -----------------------------------------------------------------------------


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator] | None,
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> list:
    """One pipeline stage: forward then backward of each micro-batch in turn, accumulating
    gradients. ``seq_length``, ``micro_batch_size``, ``decoder_seq_length`` and ``p2p_communicator``
    are accepted for a uniform signature and not used (nothing is sent between stages)."""
    _require_initialized()
    _common_checks(num_microbatches, forward_only, collect_non_loss_data)
    chunks = _as_chunks("model", model, many=False)
    iterators = _as_chunks("data_iterator", data_iterator, many=False)
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported by forward_backward_no_pipelining")
    config = _config_of(chunks[0])
    pgs = resolve_pg_collection(pg_collection, _ONE_STAGE_GROUPS, "forward_backward_no_pipelining")
    pp_size = group_size(pgs.pp)
    if pp_size != 1:
        raise ValueError(
            "forward_backward_no_pipelining needs pipeline_model_parallel_size 1, got "
            f"{pp_size}: use get_forward_backward_func()"
        )
    with _timed(config, "forward-backward", 1):
        store, total_tokens = run_schedule(
            [no_pipelining_table(num_microbatches, forward_only)],
            RunOptions(
                forward_step_func, iterators, chunks, num_microbatches, config, None, None,
                group_size(pgs.cp), forward_only, collect_non_loss_data, first_val_step,
            ),
        )
        _finalize(chunks, config, forward_only, total_tokens, pg_collection, force_all_reduce)
    return store


def _pipelined(
    kind: str,
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None,
    forward_only: bool,
    collect_non_loss_data: bool,
    first_val_step: bool | None,
    adjust_tensor_shapes_fn: Callable | None,
    p2p_communicator: P2PCommunicator | None,
    pg_collection: ProcessGroupCollection | None,
    force_all_reduce: bool | None,
) -> list:
    """The checks and set-up shared by the pipelined schedules, then the runner on ``kind``'s
    tables. Every check uses only what all ranks agree on, so bad input raises on every rank
    before any of them communicates."""
    _require_initialized()
    _common_checks(num_microbatches, forward_only, collect_non_loss_data)
    interleaved = _SCHEDULE_REGISTRY[kind].chunks == "list"
    chunks = _as_chunks("model", model, many=_SCHEDULE_REGISTRY[kind].chunks != "one", need_list=interleaved)
    if kind == "zb-v" and len(chunks) != 2:
        raise ValueError(f"the zb-v schedule runs 2 model chunks per rank (a V: chunk 0 is stage "
                         f"rank, chunk 1 stage 2 * pp - 1 - rank), got {len(chunks)}")
    if interleaved:  # checked here, counted after the table's checks (Megatron-core's order)
        _as_chunks("data_iterator", data_iterator, many=True, need_list=True)
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported: every stage sends [s, b, h]")
    layout = parallel_state.get_pipeline_model_parallel_layout()
    if kind == "zb-v" and layout != "v" and parallel_state.get_virtual_pipeline_model_parallel_world_size():
        raise ValueError("the zb-v schedule runs model chunks built in the V layout: call "
                         "parallel_state.set_pipeline_model_parallel_layout('v') before building the model")
    if kind != "zb-v" and layout == "v":
        raise ValueError(f"parallel_state's pipeline layout is 'v' (ZB-V's): the {kind} schedule runs "
                         "model chunks built in the interleaved layout")
    config = _config_of(chunks[0])
    if getattr(config, "overlap_p2p_comm", False):
        raise ValueError("config.overlap_p2p_comm=True is not supported: the schedules wait for "
                         "each exchange (set it to False)")
    communicator, pgs = _groups(p2p_communicator, pg_collection, config)
    pp_size = communicator.pp_group.size()
    num_chunks = len(chunks)
    if pp_size > 1 or num_chunks > 1:
        for chunk in chunks:
            try:
                get_attr_wrapped_model(chunk, "set_input_tensor")
            except AttributeError:
                raise AttributeError(
                    f"the model ({type(chunk).__name__}) has no set_input_tensor(tensor): with "
                    f"pipeline_model_parallel_size {pp_size} the schedule hands each stage its "
                    "input activation through it"
                ) from None
    shape = _tensor_shape(seq_length, micro_batch_size, config, pgs, decoder_seq_length)

    spec = _SCHEDULE_REGISTRY[kind]
    tables = spec.build_tables(num_microbatches, num_chunks, pp_size, config, forward_only)
    if isinstance(data_iterator, list) or interleaved:
        iterators = _as_chunks("data_iterator", data_iterator, many=True, need_list=interleaved)
        if interleaved and len(iterators) != len(chunks):
            raise ValueError(
                f"the {kind} schedule needs one data iterator per model chunk: got "
                f"{len(iterators)} for {len(chunks)} chunks"
            )
        iterators = iterators * len(chunks) if len(iterators) == 1 else iterators
    else:
        iterators = [data_iterator] * len(chunks)
    if len(iterators) != len(chunks):
        raise ValueError(f"got {len(iterators)} data iterators for {len(chunks)} model chunks")

    with _timed(config, "forward-backward", 1):
        store, total_tokens = run_schedule(
            tables,
            RunOptions(
                forward_step_func, iterators, chunks, num_microbatches, config, shape, communicator,
                group_size(pgs.cp), forward_only, collect_non_loss_data, first_val_step,
                spec.layout,
            ),
        )
        _finalize(chunks, config, forward_only, total_tokens, pg_collection, force_all_reduce)
    return store


def _pipelined_schedule(kind: str, name: str, doc: str) -> Callable[..., list]:
    """The public function of the pipelined schedule ``kind``: Megatron-core's keywords, run by
    ``_pipelined``."""

    def schedule(
        *,
        forward_step_func: ForwardStepFunc,
        data_iterator: Iterator | list[Iterator] | None,
        model: torch.nn.Module | list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator: P2PCommunicator | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        force_all_reduce: bool | None = False,
    ) -> list:
        return _pipelined(
            kind, forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            # the interleaved schedule exchanges seq_length positions, as Megatron-core's does
            decoder_seq_length=None if kind == "interleaved" else decoder_seq_length,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
            p2p_communicator=p2p_communicator, pg_collection=pg_collection, force_all_reduce=force_all_reduce,
        )

    schedule.__name__ = schedule.__qualname__ = name
    schedule.__doc__ = doc
    return schedule


forward_backward_pipelining_without_interleaving = _pipelined_schedule(
    "1f1b",
    "forward_backward_pipelining_without_interleaving",
    """1F1B (PipeDream-Flush): stage r runs ``min(pp - r - 1, m)`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.

    A stage holds at most ``min(pp - r, m)`` micro-batches' activations at any time. Custom
    process groups: pass both ``p2p_communicator`` and ``pg_collection`` (or neither).
    """,
)
forward_backward_pipelining_gpipe = _pipelined_schedule(
    "gpipe",
    "forward_backward_pipelining_gpipe",
    """GPipe: the forwards of all micro-batches, then all their backwards in the same order.

    Every stage holds the activations of all ``num_microbatches`` at the peak; 1F1B computes the
    same gradients with at most ``pipeline_model_parallel_size`` in flight. ``model`` may be a
    list of chunks (a virtual pipeline), run in the interleaved schedule's forward order.
    """,
)
forward_backward_pipelining_with_interleaving = _pipelined_schedule(
    "interleaved",
    "forward_backward_pipelining_with_interleaving",
    """Interleaved 1F1B over a virtual pipeline: ``model`` is this rank's list of ``v`` chunks
    (chunk c is virtual stage ``c * pp + rank``) and ``data_iterator`` one iterator per chunk.

    Forwards go in ``get_schedule_table`` order (groups of
    ``config.microbatch_group_size_per_vp_stage`` micro-batches, default ``pp``, through chunk 0,
    then chunk 1, ...), backwards in the same order through the chunks last to first; rank r
    warms up with ``2 (pp - r - 1) + (v - 1) g`` forwards. The pipeline bubble is
    ``(pp - 1) / (v m)`` of the ideal time instead of 1F1B's ``(pp - 1) / m``. As in Megatron-core,
    ``g`` must lie in ``[pp, m]`` (ValueError) and ``m mod g`` be 0 or at least ``pp``
    (RuntimeError). The stages exchange ``seq_length`` positions; ``decoder_seq_length`` is
    ignored here, as in Megatron-core's interleaved schedule.
    """,
)
forward_backward_pipelining_zero_bubble_h1 = _pipelined_schedule(
    "zb-h1",
    "forward_backward_pipelining_zero_bubble_h1",
    """ZB-H1 (``zero_bubble_h1_table``): 1F1B with each backward split into its input half ``I``,
    which the previous stage waits for, and its weight half ``W``, which fills the bubble
    (``split_backward``). 1F1B's peak activation memory; a third of its bubble when F, I and W
    cost the same. The same arguments as the other schedules; the gradients equal 1F1B's.""",
)
forward_backward_pipelining_zbv = _pipelined_schedule(
    "zb-v",
    "forward_backward_pipelining_zbv",
    """ZB-V (``zbv_table``): two model chunks per rank in a V, chunk 0 holding virtual stage
    ``rank`` and chunk 1 stage ``2 pp - 1 - rank`` (so rank 0 holds the first and the last
    stage), backwards split into ``I`` and ``W``. No rank idles between its first and its last
    action when F, I and W cost the same, at 1F1B's peak activation memory. ``model`` and
    ``data_iterator`` are lists of two, built for the V (``schedule_tables.virtual_stage`` with
    ``layout="v"``); ``num_microbatches`` must be at least ``2 pp - 1``.""",
)

_SCHEDULE_FUNCTIONS: dict[str, Callable[..., list]] = {
    "no_pipelining": forward_backward_no_pipelining,
    "1f1b": forward_backward_pipelining_without_interleaving,
    "gpipe": forward_backward_pipelining_gpipe,
    "interleaved": forward_backward_pipelining_with_interleaving,
    "zb-h1": forward_backward_pipelining_zero_bubble_h1,
    "zb-v": forward_backward_pipelining_zbv,
}
