"""Pipeline schedules as tables of typed actions, and the common clock they run on.

A schedule is one ordered table per pipeline rank of ``Action(kind, microbatch, chunk)``:
``F`` a forward, ``B`` a whole backward, ``I`` the input-gradient half of a backward (what the
previous stage waits for) and ``W`` its weight-gradient half (what nobody waits for). Model chunk
``c`` of rank ``r`` is one virtual stage of the pipeline: ``c * pp + r`` in the interleaved
layout, and in the V layout of ZB-V (two chunks) ``r`` for chunk 0 and ``2 pp - 1 - r`` for
chunk 1, so rank 0 holds both the first and the last stage.

``plan_schedule`` places every rank's table on a common clock (one action a tick, each at the
first tick after what it needs was made) and ``format_pipeline_order`` draws it. A new schedule
is a new table.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Sequence


class ActionKind(str, enum.Enum):
    """What an action computes. The values are the long names, the letters are the chart's."""

    F = "forward"
    B = "backward"
    I = "backward_input"  # noqa: E741
    W = "backward_weight"


FORWARD, BACKWARD = ActionKind.F, ActionKind.B
BACKWARD_INPUT, BACKWARD_WEIGHT = ActionKind.I, ActionKind.W
LAYOUTS = ("interleaved", "v")


class Action(NamedTuple):
    """One entry of a schedule table: ``kind`` of ``microbatch`` through model ``chunk``."""

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.name}{self.microbatch}"


ScheduleEntry = Action  # the name the tables had before actions were typed


def virtual_stage(rank: int, chunk: int, pp_size: int, layout: str = "interleaved") -> int:
    """The virtual pipeline stage that model ``chunk`` of pipeline ``rank`` holds."""
    if layout == "v":
        return rank if chunk == 0 else 2 * pp_size - 1 - rank
    return chunk * pp_size + rank


def stage_location(stage: int, pp_size: int, layout: str = "interleaved") -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual ``stage`` (the inverse of ``virtual_stage``)."""
    if layout == "v":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    return stage % pp_size, stage // pp_size


# Tables ------------------------------------------------------------------------------------


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> list[tuple[int, int]]:
    """The forward order of the interleaved schedule, as Megatron-core builds it: a list of
    ``(microbatch, chunk)``. Micro-batches go in groups of ``microbatch_group_size_per_vp_stage``
    (the last group takes the rest); each group runs through chunk 0, then chunk 1, ...

    For 5 micro-batches, 2 chunks and groups of 3:
    ``[(0,0), (1,0), (2,0), (0,1), (1,1), (2,1), (3,0), (4,0), (3,1), (4,1)]``.
    """
    _require_positive_int("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage)
    table = []
    for first in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        last = min(first + microbatch_group_size_per_vp_stage, num_microbatches)
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(first, last))
    return table


def schedule_table(
    forward_order: Sequence[tuple[int, int]],
    num_warmup: int,
    forward_only: bool = False,
    num_model_chunks: int = 1,
) -> list[Action]:
    """One rank's ordered table: ``num_warmup`` forwards, then one forward and one backward in
    turn, then the remaining backwards.

    Forwards follow ``forward_order`` (``(microbatch, chunk)`` pairs); backwards follow it too with
    the chunks reversed (the backward of a micro-batch goes through the chunks last to first).
    Forward-only tables hold the forwards alone.
    """
    forwards = [Action(FORWARD, mb, chunk) for mb, chunk in forward_order]
    if forward_only:
        return forwards
    backwards = [Action(BACKWARD, mb, num_model_chunks - 1 - chunk) for mb, chunk in forward_order]
    num_warmup = min(num_warmup, len(forwards))
    table = forwards[:num_warmup]
    for i in range(len(forwards) - num_warmup):
        table += [forwards[num_warmup + i], backwards[i]]
    return table + backwards[len(forwards) - num_warmup:]


def no_pipelining_table(num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """One stage: the forward and backward of each micro-batch in turn."""
    return schedule_table([(mb, 0) for mb in range(num_microbatches)], 0, forward_only)


def gpipe_table(
    num_microbatches: int, forward_only: bool = False, num_model_chunks: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> list[Action]:
    """GPipe: every forward, then every backward (the same on every rank)."""
    group = microbatch_group_size_per_vp_stage or num_microbatches
    order = get_schedule_table(num_microbatches, num_model_chunks, group)
    return schedule_table(order, len(order), forward_only, num_model_chunks)


def one_f_one_b_table(
    num_microbatches: int, pp_size: int, pp_rank: int, forward_only: bool = False
) -> list[Action]:
    """1F1B (PipeDream-Flush): stage r warms up with ``min(pp - r - 1, m)`` forwards."""
    order = [(mb, 0) for mb in range(num_microbatches)]
    return schedule_table(order, min(pp_size - pp_rank - 1, num_microbatches), forward_only)


def interleaved_table(
    num_microbatches: int,
    num_model_chunks: int,
    microbatch_group_size_per_vp_stage: int,
    pp_size: int,
    pp_rank: int,
    forward_only: bool = False,
) -> list[Action]:
    """Interleaved 1F1B: forwards in ``get_schedule_table`` order, Megatron-core's warm-up count
    ``2 (pp - r - 1) + (v - 1) g`` on rank r."""
    order = get_schedule_table(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage)
    num_warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
    return schedule_table(order, num_warmup, forward_only, num_model_chunks)


def zero_bubble_h1_table(
    num_microbatches: int, pp_size: int, pp_rank: int, forward_only: bool = False
) -> list[Action]:
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into ``I`` and ``W``, rank r
    holding back its last ``r`` weight halves.

    The warm-up is 1F1B's (``pp - r - 1`` forwards); then each forward is followed by the next
    ``I``, and a ``W`` runs as soon as more than ``r`` are pending; the held-back ``W`` fill the
    end, where 1F1B idles waiting for backwards. Every rank holds at most ``pp`` micro-batches'
    activations (1F1B's peak, on its rank 0), and the bubble is ``(pp - 1)(F + I - W)`` instead
    of 1F1B's ``(pp - 1)(F + I + W)``: a third of it when the three cost the same.
    """
    if forward_only:
        return one_f_one_b_table(num_microbatches, pp_size, pp_rank, forward_only=True)
    num_warmup = min(pp_size - pp_rank - 1, num_microbatches)
    table = [Action(FORWARD, mb, 0) for mb in range(num_warmup)]
    pending: list[int] = []
    for mb in range(num_microbatches):
        if num_warmup + mb < num_microbatches:
            table.append(Action(FORWARD, num_warmup + mb, 0))
        table.append(Action(BACKWARD_INPUT, mb, 0))
        pending.append(mb)
        if len(pending) > pp_rank:
            table.append(Action(BACKWARD_WEIGHT, pending.pop(0), 0))
    return table + [Action(BACKWARD_WEIGHT, mb, 0) for mb in pending]


def zbv_table(
    num_microbatches: int, pp_size: int, pp_rank: int, forward_only: bool = False
) -> list[Action]:
    """ZB-V (Qi et al., 2024): two model chunks per rank in the V layout (chunk 0 is stage r,
    chunk 1 stage ``2 pp - 1 - r``), backwards split into ``I`` and ``W``.

    Phases on rank r: ``2 (pp - r) - 1`` chunk-0 forwards; ``r`` pairs of a chunk-1 and a
    chunk-0 forward; ``pp - r`` rounds of chunk 1's F, I, W; a steady state of chunk 0's F, I,
    W and chunk 1's F, I, W; then ``r`` pairs of I (chunk 0, chunk 1), ``pp - r`` pairs of
    chunk 0's I and W, and the remaining weight halves. With F, I and W of equal cost no rank
    idles between its first and its last action; a rank holds at most ``2 pp`` chunk
    activations, 1F1B's peak. Needs ``num_microbatches >= 2 pp - 1``.
    """
    if num_microbatches < 2 * pp_size - 1:
        raise ValueError(
            f"the zb-v schedule needs num_microbatches >= 2 * pipeline size - 1 = {2 * pp_size - 1}, "
            f"got {num_microbatches}"
        )
    count = {(kind, chunk): 0 for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) for chunk in (0, 1)}
    table: list[Action] = []

    def run(*steps: tuple[ActionKind, int]) -> None:
        for kind, chunk in steps:
            table.append(Action(kind, count[kind, chunk], chunk))
            count[kind, chunk] += 1

    F, I, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT  # noqa: E741
    m, p, r = num_microbatches, pp_size, pp_rank
    if forward_only:
        return [Action(F, mb, chunk) for chunk in (0, 1) for mb in range(m)]
    for _ in range(2 * (p - r) - 1):
        run((F, 0))
    for _ in range(r):
        run((F, 1), (F, 0))
    for _ in range(p - r):
        run((F, 1), (I, 1), (W, 1))
    while count[F, 1] < m:
        if count[F, 0] < m:
            run((F, 0))
        run((I, 0), (W, 0), (F, 1), (I, 1), (W, 1))
    for _ in range(r):
        run((I, 0), (I, 1))
    for _ in range(p - r):
        run((I, 0), (W, 0))
    for chunk in (1, 0):
        while count[W, chunk] < m:
            run((W, chunk))
    return table


# The clock ---------------------------------------------------------------------------------


def normalize_table(table: Sequence, rank: int, num_model_chunks: int) -> list[Action]:
    """A table as ``Action``s; plain ``(kind, microbatch, chunk)`` tuples are accepted with a kind
    given as an ``ActionKind``, its letter or its long name."""
    result = []
    for entry in table:
        kind = None
        if isinstance(entry, tuple) and len(entry) == 3:
            raw = entry[0]
            if isinstance(raw, ActionKind):
                kind = raw
            elif isinstance(raw, str):
                kind = ActionKind.__members__.get(raw) or next(
                    (k for k in ActionKind if k.value == raw), None)
        if (
            kind is None or not isinstance(entry[1], int) or not isinstance(entry[2], int)
            or not 0 <= entry[2] < num_model_chunks
        ):
            raise ValueError(
                f"rank {rank}: schedule entry {entry!r} is not (FORWARD | BACKWARD | "
                f"BACKWARD_INPUT | BACKWARD_WEIGHT, microbatch, chunk < {num_model_chunks})"
            )
        result.append(Action(kind, entry[1], entry[2]))
    return result


def check_tables(tables: Sequence[Sequence], num_model_chunks: int = 1) -> list[list[Action]]:
    """Every rank's table as ``Action``s, after checking that each holds every action once, that
    each forward has one backward (``B``, or ``I`` followed later by ``W``) or none at all (a
    forward-only table), and that all ranks run the same forwards. Raises ValueError."""
    checked = []
    forwards = []
    for r, raw in enumerate(tables):
        table = normalize_table(raw, r, num_model_chunks)
        position: dict[Action, int] = {}
        for i, action in enumerate(table):
            if action in position:
                raise ValueError(f"rank {r}: schedule entry {action!r} appears twice")
            position[action] = i
        mine = {(a.microbatch, a.chunk) for a in table if a.kind == FORWARD}
        whole = {(a.microbatch, a.chunk) for a in table if a.kind == BACKWARD}
        halves = {(a.microbatch, a.chunk) for a in table if a.kind == BACKWARD_INPUT}
        weights = {(a.microbatch, a.chunk) for a in table if a.kind == BACKWARD_WEIGHT}
        if halves != weights:
            raise ValueError(f"rank {r}: every BACKWARD_INPUT needs its BACKWARD_WEIGHT and back; "
                             f"unmatched: {sorted(halves ^ weights)}")
        if whole & halves:
            raise ValueError(f"rank {r}: (microbatch, chunk) {sorted(whole & halves)[0]} has both a "
                             "whole backward and backward halves")
        if (whole or halves) and whole | halves != mine:
            raise ValueError(f"rank {r}: the backward entries do not match the forward entries")
        for mb, chunk in halves:
            if position[Action(BACKWARD_WEIGHT, mb, chunk)] < position[Action(BACKWARD_INPUT, mb, chunk)]:
                raise ValueError(
                    f"rank {r}: BACKWARD_WEIGHT of microbatch {mb}, chunk {chunk} comes before its "
                    "BACKWARD_INPUT"
                )
        forwards.append(frozenset(mine))
        checked.append(table)
    if len(set(forwards)) > 1:
        raise ValueError("the ranks' tables run different (microbatch, chunk) forwards")
    return checked


def dependencies(action: Action, rank: int, pp_size: int, num_stages: int, layout: str) -> list[tuple]:
    """What ``action`` of ``rank`` waits for, as ``(kind, microbatch, virtual stage)``: a forward
    the previous stage's forward; a backward (or its input half) its own forward and the next
    stage's input gradient (``"grad"``: made by that stage's B or I); a weight half its own I."""
    kind, mb, chunk = action
    stage = virtual_stage(rank, chunk, pp_size, layout)
    if kind == FORWARD:
        return [(FORWARD, mb, stage - 1)] if stage > 0 else []
    if kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, mb, stage)]
    needs = [(FORWARD, mb, stage)]
    if stage < num_stages - 1:
        needs.append(("grad", mb, stage + 1))
    return needs


def plan_schedule(
    tables: Sequence[Sequence], num_model_chunks: int = 1, layout: str = "interleaved"
) -> list[list[Action | None]]:
    """Places every rank's table on a common clock.

    ``tables[r]`` is pipeline rank r's table. Each rank runs its actions in order, one per tick,
    each at the first tick after what it needs was made (``dependencies``). Returns, per rank,
    the action (or None: idle) at every tick; all ranks have the same number of ticks. Raises
    ValueError if a table lacks or repeats an action, runs a weight half before its input half,
    or orders the actions so that ranks wait for each other forever.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "v" and num_model_chunks != 2:
        raise ValueError(f"the V layout has 2 model chunks per rank, got {num_model_chunks}")
    checked = check_tables(tables, num_model_chunks)
    pp_size = len(checked)
    num_stages = pp_size * num_model_chunks
    made: dict[tuple, int] = {}  # (kind, microbatch, stage) -> tick
    position = [0] * pp_size
    plan: list[list[Action | None]] = [[] for _ in range(pp_size)]
    tick = 0
    while any(position[r] < len(checked[r]) for r in range(pp_size)):
        ran = []
        for r in range(pp_size):
            action = checked[r][position[r]] if position[r] < len(checked[r]) else None
            if action is not None and not all(
                made.get(need, tick) < tick
                for need in dependencies(action, r, pp_size, num_stages, layout)
            ):
                action = None
            plan[r].append(action)
            if action is not None:
                ran.append((r, action))
        if not ran:
            waiting = {r: str(checked[r][position[r]]) for r in range(pp_size)
                       if position[r] < len(checked[r])}
            raise ValueError(
                f"the schedule tables wait for each other forever; next actions per rank: {waiting}"
            )
        for r, action in ran:
            stage = virtual_stage(r, action.chunk, pp_size, layout)
            made[(action.kind, action.microbatch, stage)] = tick
            if action.kind in (BACKWARD, BACKWARD_INPUT):
                made[("grad", action.microbatch, stage)] = tick
            position[r] += 1
        tick += 1
    return plan


def format_pipeline_order(plan: Sequence[Sequence[Action | None]], ranks: Sequence[int] | None = None) -> str:
    """A chart of a plan (``plan_schedule``'s result), one row per tick and one column per rank:
    ``<chunk><F|B|I|W><microbatch>``, blank when idle. ``ranks`` picks the columns (all by
    default)."""
    ranks = list(range(len(plan))) if ranks is None else list(ranks)
    ticks = max((len(plan[r]) for r in ranks), default=0)
    cells = [[str(plan[r][t]) if t < len(plan[r]) and plan[r][t] is not None else ""
              for r in ranks] for t in range(ticks)]
    width = max([len(c) for row in cells for c in row] + [len(f"rank {r}") for r in ranks])
    tick_width = len(f"tick {max(ticks - 1, 0)}") + 1
    lines = [" " * tick_width + " ".join(f"rank {r}".ljust(width) for r in ranks).rstrip()]
    for t, row in enumerate(cells):
        lines.append((f"tick {t}".ljust(tick_width) + " ".join(c.ljust(width) for c in row)).rstrip())
    return "\n".join(lines)


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
