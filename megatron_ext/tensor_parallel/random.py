"""Model-parallel random number streams and activation checkpointing that replays them.

Tensor-parallel ranks hold different shards of the same layer, so the randomness applied to a
shard (weight initialisation, dropout inside a tensor-parallel region) must differ across TP ranks
and agree across data-parallel replicas: the ``model-parallel-rng`` stream. Randomness applied to
replicated activations must agree across TP ranks: the default generator, also registered as
``data-parallel-rng``. On a machine without CUDA the tracker forks the CPU generator, so CPU runs
follow the same rules; so do CPU (gloo) jobs on a machine that has a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.parallel_state import ParallelStateError
from megatron_ext.split_backward import active_deferral, backward_input, in_split_backward
from megatron_ext.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"

# Megatron-core's seed offsets, kept so runs seeded alike draw the same streams.
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def _uses_cuda() -> bool:
    """Whether the streams live on the CUDA generator: a GPU is visible and the job is not a
    CPU-only one (a default process group without NCCL, e.g. gloo on a machine that has a GPU)."""
    if not torch.cuda.is_available():
        return False
    return not dist.is_initialized() or "nccl" in str(dist.get_backend())


def _cuda_generator() -> torch.Generator:
    return torch.cuda.default_generators[torch.cuda.current_device()]


def _get_rng_state(graph_safe: bool = False) -> torch.Tensor | torch.Generator:
    """State of the generator the tracker forks: the current CUDA device's, else the CPU's.
    ``graph_safe``: the state as a generator object (the CUDA generator's graph-safe state, as CUDA
    graphs need; without CUDA a copy of the CPU generator, which has no graph-safe state)."""
    if graph_safe:
        return (
            _cuda_generator().graphsafe_get_state() if _uses_cuda() else torch.default_generator.clone_state()
        )
    return torch.cuda.get_rng_state() if _uses_cuda() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor | torch.Generator, graph_safe: bool = False) -> None:
    if graph_safe and _uses_cuda():
        _cuda_generator().graphsafe_set_state(state)
    elif graph_safe:
        torch.set_rng_state(state.get_state())
    elif _uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seeded_state(seed: int, graph_safe: bool = False) -> torch.Tensor | torch.Generator:
    """The state a generator seeded with ``seed`` starts from; the current state is kept."""
    if graph_safe:
        state = _cuda_generator().clone_state() if _uses_cuda() else torch.Generator()
        state.manual_seed(seed)
        return state
    if _uses_cuda():
        outer = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(outer)
        return state
    return torch.Generator().manual_seed(seed).get_state()


def convert_cuda_rng_state(
    state: torch.Tensor | torch.Generator, to_graphable: bool = False
) -> torch.Tensor | torch.Generator:
    """Converts a generator state between its tensor form and its graph-safe form (a
    ``torch.Generator``, as CUDA graphs need); a state already in the asked form is returned as is.
    Without CUDA the graph-safe form is a CPU ``torch.Generator`` holding the state."""
    if not isinstance(state, (torch.Tensor, torch.Generator)):
        raise ValueError(f"Invalid state type: {type(state)}")
    if not to_graphable:
        return state.get_state() if isinstance(state, torch.Generator) else state
    if isinstance(state, torch.Generator):
        return state
    if not _uses_cuda():
        generator = torch.Generator()
        generator.set_state(state)
        return generator
    outer = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(state)
    graphable = _cuda_generator().clone_state()
    torch.cuda.set_rng_state(outer)
    return graphable


_DEFAULT_STATE_NAME = "default-rng"


class CudaRNGStatesTracker:
    """Named generator states that code can step into with :meth:`fork`.

    ``add(name, seed)`` records the state a generator seeded with ``seed`` starts from;
    ``fork(name)`` swaps that state in, runs the block, saves where the stream got to and puts the
    outer state back. Forks nest: entering a stream saves the progress of the tracked stream being
    left, so ``fork("a")`` inside ``fork("b")`` inside ``fork("a")`` continues stream "a" and never
    repeats its numbers. Names and seeds are unique. (The name is Megatron-core's; without CUDA the
    states are the CPU generator's.) ``use_cudagraphable_rng`` keeps the states as generator
    objects: graph-safe CUDA generator states, as CUDA graphs need, or without CUDA CPU generators
    (the same numbers as the tensor states; the CPU has no graphs to capture).
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        self.reset()
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        """Forgets every state and seed."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor | torch.Generator] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = _DEFAULT_STATE_NAME

    def get_states(self) -> dict[str, torch.Tensor | torch.Generator]:
        """A copy of the name -> state map."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor | torch.Generator]) -> None:
        """Replaces the name -> state map, e.g. with one from :meth:`get_states`."""
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Registers stream ``name`` starting from ``seed``; the current generator state is kept."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"CudaRNGStatesTracker: seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"CudaRNGStatesTracker: cuda rng state {name!r} already exists")
        self.states_[name] = _seeded_state(seed, self.use_cudagraphable_rng)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Runs the block on stream ``name``, then goes back to the stream it was on."""
        if name not in self.states_:
            raise RuntimeError(
                f"CudaRNGStatesTracker: cuda rng state {name!r} is not added (known: "
                f"{sorted(self.states_)}); "
                "call model_parallel_cuda_manual_seed(seed) first"
            )
        graph_safe = self.use_cudagraphable_rng
        outer_state = _get_rng_state(graph_safe)
        outer_name = self._current_state_name
        if outer_name != _DEFAULT_STATE_NAME:
            # Save the progress of the tracked stream we leave: an inner fork of it continues there.
            self.states_[outer_name] = outer_state
        _set_rng_state(self.states_[name], graph_safe)
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise RuntimeError(
                    f"CudaRNGStatesTracker: current state name {self._current_state_name!r} is not the "
                    f"forked state name {name!r}"
                )
            self.states_[name] = _get_rng_state(graph_safe)
            if outer_name != _DEFAULT_STATE_NAME:
                outer_state = self.states_[outer_name]
            _set_rng_state(outer_state, graph_safe)
            self._current_state_name = outer_name


class _InferenceCudaRNGStatesTracker(CudaRNGStatesTracker):
    """Inference needs no reproducible streams: add and set_states do nothing, fork runs the block
    on the current generator."""

    def add(self, name: str, seed: int) -> None:
        pass

    def set_states(self, states: dict) -> None:
        pass

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


_CUDA_RNG_STATE_TRACKER: CudaRNGStatesTracker | None = None
_CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Creates the process-wide tracker once (again with ``force_reset``). TransformerEngine's
    tracker (``use_te_rng_tracker``) is not available, so the plain one is used, as Megatron-core
    does without TransformerEngine."""
    global _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED
    if force_reset:
        _CUDA_RNG_STATE_TRACKER = None
        _CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    if _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return
    cls = _InferenceCudaRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
    _CUDA_RNG_STATE_TRACKER = cls(
        use_cudagraphable_rng=use_cudagraphable_rng, is_inference_rng_tracker=inference_rng_tracker
    )
    _CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> CudaRNGStatesTracker:
    """The process-wide tracker (created on first use with these settings)."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def get_all_rng_states() -> dict[str, torch.Tensor | torch.Generator]:
    """The tracker's name -> state map (the live one, not a copy)."""
    if not _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        raise ParallelStateError("Tried getting all rng states but RNG Tracker has not been initalized!")
    return _CUDA_RNG_STATE_TRACKER.states_


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: Any) -> bool:
    """Whether the tracker keeps graph-safe (CUDA graph capturable) states."""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
) -> None:
    """Seeds the tracker's streams (call after initialize_model_parallel).

    CUDA default generator and ``data-parallel-rng``: ``seed`` (same on every rank);
    ``model-parallel-rng``: ``seed + 2718 + tp_rank`` (differs across TP ranks, same across DP);
    ``expert-parallel-rng``: ``seed + 1024 + 100 * ep_rank + etp_rank``. The CPU generator is left
    alone (as ``torch.cuda.manual_seed`` leaves it in Megatron-core), so weights drawn on the CPU
    (``use_cpu_initialization``) depend only on the global CPU seed.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = _CUDA_RNG_STATE_TRACKER
    tracker.reset()
    if _uses_cuda():
        torch.cuda.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    tracker.add(
        _EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + (etp_rank or 0),
    )


# Whether a checkpointed function is running its forward or its recomputation.
IS_CHECKPOINTING = False


def is_checkpointing() -> bool:
    """Whether code runs inside checkpoint()'s forward or recomputation."""
    return IS_CHECKPOINTING


@contextlib.contextmanager
def _checkpointing() -> Iterator[None]:
    global IS_CHECKPOINTING
    IS_CHECKPOINTING = True
    try:
        yield
    finally:
        IS_CHECKPOINTING = False


def _rng_snapshot() -> tuple[torch.Tensor, Any, dict]:
    tracker = get_cuda_rng_tracker()
    graph_safe = is_graph_safe_cuda_rng_tracker(tracker)
    cuda_state = _get_rng_state(graph_safe) if _uses_cuda() else None
    if graph_safe and cuda_state is not None:
        cuda_state = convert_cuda_rng_state(convert_cuda_rng_state(cuda_state), to_graphable=True)
    states = {
        k: v.clone_state() if isinstance(v, torch.Generator) else v for k, v in tracker.get_states().items()
    }
    return torch.get_rng_state(), cuda_state, states


def _rng_restore(snapshot: tuple[torch.Tensor, Any, dict]) -> None:
    cpu_state, cuda_state, tracker_states = snapshot
    tracker = get_cuda_rng_tracker()
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        _set_rng_state(cuda_state, is_graph_safe_cuda_rng_tracker(tracker))
    tracker.set_states(dict(tracker_states))


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
        with torch.no_grad(), _checkpointing():
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
        _check_backward_mode()
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
            with torch.enable_grad(), _checkpointing():
                outputs = ctx.run_function(*inputs)
        finally:
            _rng_restore(now)

        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        return (None, None) + _backward_through(outputs, grad_outputs, inputs)


def _check_backward_mode() -> None:
    if not torch.autograd._is_checkpoint_valid() and not in_split_backward():
        raise RuntimeError("checkpoint is not compatible with torch.autograd.grad(); use .backward()")


def _backward_through(outputs: Sequence[Any], grad_outputs: Sequence[Any], inputs: Sequence[Any]) -> tuple:
    """The backward of a recomputed region: returns the gradients of ``inputs``. Inside a
    zero-bubble schedule's input half (``split_backward.backward_input``) the region's weight
    gradients are deferred with the rest of the stage's."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    deferral = active_deferral()
    if deferral is not None:
        grads, inner = backward_input(
            [o for o, _ in pairs], [g for _, g in pairs],
            [i if isinstance(i, torch.Tensor) else None for i in inputs],
        )
        deferral.nested.append(inner)
        return tuple(grads)
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return tuple(i.grad if isinstance(i, torch.Tensor) else None for i in inputs)


def checkpoint(function: Callable, distribute_saved_activations: bool, *args: Any) -> Any:
    """Runs ``function(*args)`` keeping only its inputs; backward recomputes it under the random
    states of the forward, so the gradients equal those of the uncheckpointed function."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """The autograd node of CheckpointWithoutOutput: forward runs without keeping activations;
    backward back-propagates through the outputs CheckpointWithoutOutput recomputed."""

    @staticmethod
    def forward(
        ctx, run_function: Callable, checkpoint_without_output_obj: "CheckpointWithoutOutput", *args: Any
    ) -> Any:
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_indices = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.non_tensor_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i].detach() for i in ctx.tensor_indices))
        ctx.input_requires_grad = [args[i].requires_grad for i in ctx.tensor_indices]
        checkpoint_without_output_obj.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: Any) -> tuple:
        if getattr(ctx, "outputs", None) is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: backward reached the checkpoint before its recomputation ran; "
                "call discard_output_and_register_recompute(hook_tensor) with a tensor whose gradient is "
                "computed before the discarded outputs are needed"
            )
        inputs, outputs = ctx.inputs, ctx.outputs
        ctx.outputs = ctx.inputs = None
        return (None, None) + _backward_through(outputs, grad_outputs, inputs)


class CheckpointWithoutOutput:
    """Checkpoints a function and also frees its outputs until backward needs them.

    ``out = ckpt.checkpoint(fn, *args)`` runs ``fn`` without keeping activations; after the next
    module has consumed ``out`` (and saved it for its own backward),
    ``ckpt.discard_output_and_register_recompute(hook_tensor)`` frees the outputs' storage and
    registers a gradient hook on ``hook_tensor`` that recomputes ``fn`` under the forward's random
    states and refills the outputs' storage in place, before anything reads them in backward.
    """

    def __init__(self, fp8: bool = False) -> None:
        if fp8:
            raise NotImplementedError(
                "CheckpointWithoutOutput(fp8=True) needs TransformerEngine's FP8, which megatron_ext does "
                "not use"
            )
        self.fp8 = False
        self.run_function: Callable | None = None
        self.rng_states: Any = None
        self.ctx: Any = None
        self.outputs: tuple | None = None

    def checkpoint(self, run_function: Callable, *args: Any) -> Any:
        self.run_function = run_function
        self.rng_states = _rng_snapshot()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return outputs

    def _recompute(self, _: Any) -> None:
        if self.ctx is None:
            return
        _check_backward_mode()
        ctx = self.ctx
        inputs = list(ctx.non_tensor_args)
        for i, t, rg in zip(ctx.tensor_indices, ctx.saved_tensors, ctx.input_requires_grad):
            d = t.detach()
            d.requires_grad_(rg)
            inputs[i] = d
        now = _rng_snapshot()
        _rng_restore(self.rng_states)
        try:
            with torch.enable_grad(), _checkpointing():
                outputs = self.run_function(*inputs)
        finally:
            _rng_restore(now)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            for kept, fresh in zip(self.outputs, outputs):
                storage = kept.untyped_storage()
                storage.resize_(fresh.untyped_storage().size())
                storage.copy_(fresh.untyped_storage())
        ctx.outputs, ctx.inputs = outputs, inputs
        self.run_function = self.rng_states = self.outputs = self.ctx = None

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees the outputs' storage; the gradient hook of ``hook_tensor`` recomputes them."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)
