"""Model-parallel random number streams and activation checkpointing that replays them.

Tensor-parallel ranks hold different shards of the same layer, so the randomness applied to a
shard (weight initialisation, dropout inside a tensor-parallel region) must differ across TP ranks
and agree across data-parallel replicas: the ``model-parallel-rng`` stream. Randomness applied to
replicated activations must agree across TP ranks: the default generator, also registered as
``data-parallel-rng``. On a machine without CUDA the tracker forks the CPU generator, so CPU runs
follow the same rules.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from megatron_ext import parallel_state
from megatron_ext.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"

# Megatron-core's seed offsets, kept so runs seeded alike draw the same streams.
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def _uses_cuda() -> bool:
    return torch.cuda.is_available()


def _get_rng_state() -> torch.Tensor:
    """State of the generator the tracker forks: the current CUDA device's, else the CPU's."""
    return torch.cuda.get_rng_state() if _uses_cuda() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if _uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _uses_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states that code can step into with :meth:`fork`.

    ``add(name, seed)`` records the state a generator seeded with ``seed`` starts from;
    ``fork(name)`` swaps that state in, runs the block, saves where the stream got to and puts the
    outer state back. Names and seeds are unique. (The name is Megatron-core's; without CUDA the
    states are the CPU generator's.)
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        """Forgets every state and seed."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are never modified in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces the name -> state map, e.g. with one from :meth:`get_states`."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Registers stream ``name`` starting from ``seed``; the current generator state is kept."""
        if seed in self.seeds_:
            raise RuntimeError(f"CudaRNGStatesTracker: seed {seed} is already in use")
        if name in self.states_:
            raise RuntimeError(f"CudaRNGStatesTracker: rng state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Runs the block on stream ``name``, then restores the outer generator state."""
        if name not in self.states_:
            raise RuntimeError(
                f"CudaRNGStatesTracker: rng state {name!r} is not added (known: {sorted(self.states_)}); "
                "call model_parallel_cuda_manual_seed(seed) first"
            )
        outer = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(outer)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker."""
    return _CUDA_RNG_STATE_TRACKER


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seeds the default generator and the tracker's streams (call after initialize_model_parallel).

    default generator and ``data-parallel-rng``: ``seed`` (same on every rank);
    ``model-parallel-rng``: ``seed + 2718 + tp_rank`` (differs across TP ranks, same across DP);
    ``expert-parallel-rng``: ``seed + 1024 + tp_rank``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_PARALLEL_SEED_OFFSET + tp_rank)


def _rng_snapshot() -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    cuda_state = torch.cuda.get_rng_state() if _uses_cuda() else None
    return torch.get_rng_state(), cuda_state, get_cuda_rng_tracker().get_states()


def _rng_restore(snapshot: tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]) -> None:
    cpu_state, cuda_state, tracker_states = snapshot
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    get_cuda_rng_tracker().set_states(tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Forward: runs ``run_function`` without keeping its activations; saves the inputs and the
    generator states (CPU, CUDA, tracker).

    Backward: restores those states, reruns ``run_function`` with autograd on (so dropout draws the
    same masks), back-propagates through the recomputation, then puts the states of the moment back.
    With ``distribute_saved_activations`` the first input is kept as this TP rank's 1-D chunk
    between forward and backward (its ``.data`` is replaced, as in Megatron-core) and gathered again
    for the recomputation.
    """

    @staticmethod
    def forward(ctx, run_function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.forward_rng = _rng_snapshot()
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            first = args[0]
            ctx.input_0_shape = first.shape
            first.data = split_tensor_into_1d_equal_chunks(first.data, new_buffer=True)
        ctx.tensor_indices = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.non_tensor_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: Any) -> tuple:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint is not compatible with torch.autograd.grad(); use .backward()")
        saved = ctx.saved_tensors
        if ctx.distribute_saved_activations:
            first = saved[0]
            first.data = gather_split_1d_tensor(first.data).view(ctx.input_0_shape)
        inputs = list(ctx.non_tensor_args)
        for i, tensor in zip(ctx.tensor_indices, saved):
            detached = tensor.detach()
            detached.requires_grad_(tensor.requires_grad)
            inputs[i] = detached

        now = _rng_snapshot()
        _rng_restore(ctx.forward_rng)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _rng_restore(now)

        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)
        return (None, None) + grads


def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
    """Runs ``function(*args)`` keeping only its inputs; backward recomputes it under the random
    states of the forward, so the gradients equal those of the uncheckpointed function."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
