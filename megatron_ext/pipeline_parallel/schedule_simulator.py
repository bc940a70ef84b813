"""Runs schedule tables on a model of time: given what an F, B, I and W cost and what a transfer
between ranks costs, when does each rank finish, how much does it idle, how many activations does
it hold?

Every rank runs its table in order; an action starts when the rank is free and what it needs
(``schedule_tables.dependencies``) is made, plus ``p2p`` when that was made on another rank.
Costs are per action: for the multi-chunk schedules an action runs one chunk, so compare with
one-chunk schedules at costs divided by the number of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_ext.pipeline_parallel.schedule_tables import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    check_tables,
    dependencies,
    virtual_stage,
)


@dataclass(frozen=True)
class SimulatedSchedule:
    """``finish[r]``, ``busy[r]``, ``idle[r]`` (idle time between rank r's first action and its
    last) and ``peak_activations[r]`` (micro-batch chunks whose forward ran and whose backward,
    or weight half, has not); ``makespan`` is the last finish."""

    finish: list[float]
    busy: list[float]
    idle: list[float]
    peak_activations: list[int]

    @property
    def makespan(self) -> float:
        return max(self.finish)

    @property
    def bubble_fraction(self) -> float:
        """Time lost to the pipeline: ``makespan / ideal - 1``, ideal being the busiest rank's
        work. This is what a step costs when the optimizer waits for every rank."""
        ideal = max(self.busy)
        return self.makespan / ideal - 1

    @property
    def idle_fraction(self) -> float:
        """The largest idle time inside one rank's span over its work: the bubble when ranks
        start the next step as soon as they are done (the zero-bubble paper's measure)."""
        return max(i / b for i, b in zip(self.idle, self.busy))


def simulate_schedule(
    tables: Sequence[Sequence],
    costs: dict[str, float],
    num_model_chunks: int = 1,
    layout: str = "interleaved",
    p2p: float = 0.0,
) -> SimulatedSchedule:
    """Simulates ``tables`` with ``costs`` keyed by ``"F"``, ``"B"``, ``"I"``, ``"W"`` (``B``
    defaults to ``I + W``) and transfer latency ``p2p``."""
    checked = check_tables(tables, num_model_chunks)
    cost = {FORWARD: costs["F"], BACKWARD_INPUT: costs.get("I", 0.0),
            BACKWARD_WEIGHT: costs.get("W", 0.0)}
    cost[BACKWARD] = costs.get("B", cost[BACKWARD_INPUT] + cost[BACKWARD_WEIGHT])
    pp_size = len(checked)
    num_stages = pp_size * num_model_chunks
    made: dict[tuple, tuple[float, int]] = {}  # (kind, mb, stage) -> (time, rank)
    position = [0] * pp_size
    clock = [0.0] * pp_size
    first: list[float | None] = [None] * pp_size
    busy = [0.0] * pp_size
    live = [0] * pp_size
    peak = [0] * pp_size
    while any(position[r] < len(checked[r]) for r in range(pp_size)):
        progressed = False
        for r in range(pp_size):
            while position[r] < len(checked[r]):
                action = checked[r][position[r]]
                needs = dependencies(action, r, pp_size, num_stages, layout)
                if not all(n in made for n in needs):
                    break
                start = max([clock[r]] + [made[n][0] + (p2p if made[n][1] != r else 0.0) for n in needs])
                clock[r] = start + cost[action.kind]
                busy[r] += cost[action.kind]
                first[r] = start if first[r] is None else first[r]
                stage = virtual_stage(r, action.chunk, pp_size, layout)
                made[(action.kind, action.microbatch, stage)] = (clock[r], r)
                if action.kind in (BACKWARD, BACKWARD_INPUT):
                    made[("grad", action.microbatch, stage)] = (clock[r], r)
                if action.kind == FORWARD:
                    live[r] += 1
                    peak[r] = max(peak[r], live[r])
                elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
                    live[r] -= 1
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule tables wait for each other forever")
    idle = [clock[r] - (first[r] or 0.0) - busy[r] for r in range(pp_size)]
    return SimulatedSchedule(clock, busy, idle, peak)
