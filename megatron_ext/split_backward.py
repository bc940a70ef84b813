"""A backward in two halves, for the zero-bubble schedules.

``backward_input`` (a schedule's ``I``) computes the gradients of a stage's input activations and
nothing else: every weight gradient is deferred. ``backward_weight`` (``W``) computes the deferred
weight gradients later and accumulates them through each parameter's ``AccumulateGrad`` node, so
gradient hooks (DistributedDataParallel's buckets) fire in ``W``, never in ``I``.

How the graph is cut. Walking the autograd graph down from the stage's outputs, a node is
*weight-only* when every path below it ends at a leaf that is not a stage input (a parameter).
A *frontier* node is not weight-only but has a weight-only child: a linear layer's backward
(input and weight), a norm's, a bias addition. ``I`` runs the engine from the outputs to the
stage inputs and captures the gradient arriving at every frontier node (``GradientEdge`` inputs of
the engine), so a frontier node computes only its activation gradient then (the engine's output
mask, ``needs_input_grad`` in custom functions). ``W`` runs each frontier node once more from the
captured gradient, towards its weights only. Layers take part without knowing it: the parallel
linears (``gradient_accumulation_fusion`` into ``main_grad`` included), the fused output layer +
cross-entropy, embeddings, norms and biases; activation recomputation
(``tensor_parallel.checkpoint``) cuts the backward of its recomputed graph the same way.

Two cases run differently, both exactly:

- An output whose graph reaches no stage input (the first stage has no input activation) is
  weight-only as a whole: ``I`` does nothing for it and ``W`` runs its whole backward.
- A stage whose graph reaches one weight below two frontier nodes (a weight shared within the
  stage) would count that weight's gradient twice: its whole backward runs in ``I`` and its ``W``
  is empty.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

_engine = torch.autograd.Variable._execution_engine
# The deferral of the backward_input now running. A module global, not a thread-local: on GPUs the
# autograd engine runs backward functions on its own device threads.
_active: list["DeferredWeightGrad"] = []
_weight_passes: list["DeferredWeightGrad"] = []

Grads = list[torch.Tensor | None]


class DeferredWeightGrad:
    """What ``backward_input`` left for ``backward_weight``: per frontier node, its input edges,
    the gradients captured there and the weights below it; plus recomputed regions' own
    deferrals."""

    def __init__(self) -> None:
        self.entries: list[tuple[list[GradientEdge], Grads, tuple[torch.Tensor, ...]]] = []
        self.nested: list[DeferredWeightGrad] = []

    def __bool__(self) -> bool:
        return bool(self.entries or self.nested)


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _is_leaf(node: Node) -> bool:
    return hasattr(node, "variable")


def _topological(roots: Sequence[Node]) -> list[Node]:
    """Every node below ``roots``, children before parents."""
    order: list[Node] = []
    seen: set[Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(_children(root)))]
        while stack:
            node, it = stack[-1]
            child = next(it, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(_children(child))))
    return order


def _weights_below(node: Node, weight_only: set[Node]) -> list[Node]:
    """The weight-only nodes hanging below ``node`` (``node`` itself if it is weight-only)."""
    start = [node] if node in weight_only else [k for k in _children(node) if k in weight_only]
    found, stack = [], list(start)
    seen: set[Node] = set()
    while stack:
        k = stack.pop()
        if k not in seen:
            seen.add(k)
            found.append(k)
            stack.extend(_children(k))
    return found


def _plan(roots: Sequence[Node], input_nodes: set[Node]):
    """Returns ``[(start node, weight leaves, whole)]`` in backward order, or None when a
    weight-only node hangs below two start nodes (a shared weight). A start node is a frontier
    node, or an output's node that is weight-only as a whole (``whole``: W runs all of it)."""
    order = _topological(roots)
    reaches_input: set[Node] = set()
    weight_only: set[Node] = set()  # reaches a weight and no stage input
    for node in order:
        kids = _children(node)
        if node in input_nodes or any(k in reaches_input for k in kids):
            reaches_input.add(node)
        elif (_is_leaf(node) and node.variable.requires_grad) or any(k in weight_only for k in kids):
            weight_only.add(node)
    starts = [(n, False) for n in reversed(order)
              if n in reaches_input and any(k in weight_only for k in _children(n))]
    starts += [(r, True) for r in dict.fromkeys(roots) if r in weight_only]
    owner: dict[Node, Node] = {}
    plan = []
    for start, whole in starts:
        below = _weights_below(start, weight_only)
        for k in below:
            if owner.setdefault(k, start) is not start:
                return None
        plan.append((start, tuple(k.variable for k in below if _is_leaf(k)), whole))
    return plan


def _grad_node(t: torch.Tensor) -> Node:
    return torch.autograd.graph.get_gradient_edge(t).node


def _num_inputs(node: Node) -> int:
    return len(node._input_metadata)


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor | None],
) -> tuple[Grads, DeferredWeightGrad]:
    """The input-gradient half of ``torch.autograd.backward(outputs, grad_outputs)``.

    ``inputs`` are the stage's input activations (leaves, or None). Returns their gradients (None
    for an input that is None or that no output depends on) and the deferred weight-gradient
    work for ``backward_weight``. Only the outputs' graphs are used, so outputs whose data was
    freed (``deallocate_pipeline_outputs``) work.
    """
    deferred = DeferredWeightGrad()
    pairs = [(o, torch.ones_like(o) if g is None else g)
             for o, g in zip(outputs, grad_outputs) if o is not None and o.requires_grad]
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    if not pairs:
        return [None] * len(inputs), deferred
    tensors = tuple(o for o, _ in pairs)
    grad_tensors = tuple(g for _, g in pairs)
    plan = _plan([_grad_node(o) for o in tensors], {_grad_node(x) for x in wanted})
    _active.append(deferred)
    try:
        if plan is None:
            grads = _whole_backward(tensors, grad_tensors, wanted)
        else:
            edges = [GradientEdge(node, k) for node, _, whole in plan if not whole
                     for k in range(_num_inputs(node))]
            targets = tuple(wanted) + tuple(edges)
            grads = list(_engine.run_backward(
                tensors=tensors, grad_tensors=grad_tensors, keep_graph=True, create_graph=False,
                inputs=targets, allow_unreachable=True, accumulate_grad=False,
            )) if targets else []
            captured = iter(grads[len(wanted):])
            grads = grads[:len(wanted)]
            for node, weights, whole in plan:
                if whole:
                    edges = [torch.autograd.graph.get_gradient_edge(o) for o, _ in pairs
                             if _grad_node(o) is node]
                    node_grads = [g for o, g in pairs if _grad_node(o) is node]
                else:
                    edges = [GradientEdge(node, k) for k in range(_num_inputs(node))]
                    node_grads = [next(captured) for _ in edges]
                deferred.entries.append((edges, node_grads, weights))
    finally:
        _active.pop()
    by_id = {id(x): g for x, g in zip(wanted, grads)}
    return [None if x is None else by_id.get(id(x)) for x in inputs], deferred


def _whole_backward(tensors, grad_tensors, wanted: list[torch.Tensor]) -> Grads:
    """A plain backward into every leaf's ``.grad``; the stage inputs' gradients are returned and
    their ``.grad`` left as it was."""
    before = [x.grad for x in wanted]
    for x in wanted:
        x.grad = None
    _engine.run_backward(
        tensors=tensors, grad_tensors=grad_tensors, keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )
    grads = [x.grad for x in wanted]
    for x, b in zip(wanted, before):
        x.grad = b
    return grads


def backward_weight(deferred: DeferredWeightGrad) -> None:
    """The weight-gradient half: computes and accumulates what ``backward_input`` deferred (once;
    the deferral is empty afterwards)."""
    entries, deferred.entries = deferred.entries, []
    nested, deferred.nested = deferred.nested, []
    _weight_passes.append(deferred)
    try:
        _run_weight_entries(entries)
    finally:
        _weight_passes.pop()
    for inner in nested:
        backward_weight(inner)


def _run_weight_entries(entries) -> None:
    for edges, grads, weights in entries:
        roots = tuple(e for e, g in zip(edges, grads) if g is not None)
        if roots and weights:
            _engine.run_backward(
                tensors=roots, grad_tensors=tuple(g for g in grads if g is not None),
                keep_graph=False, create_graph=False, inputs=weights, allow_unreachable=True,
                accumulate_grad=True,
            )


def in_split_backward() -> bool:
    """Whether a ``backward_input`` or ``backward_weight`` is running: engine calls restricted to
    some inputs, inside which a recomputed region may still run its own backward."""
    return bool(_active or _weight_passes)


def active_deferral() -> DeferredWeightGrad | None:
    """The deferral of the ``backward_input`` now running, if any. A recomputed region's backward
    (which runs a backward of its own) splits it with ``backward_input`` and appends its deferral
    to this one's ``nested``."""
    return _active[-1] if _active else None
