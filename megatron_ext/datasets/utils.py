"""What the datasets share: the split names, weight normalisation, blends from a flat list, and
logging on one rank."""

from __future__ import annotations

import logging
import os
from enum import Enum

import numpy
import torch

logger = logging.getLogger(__name__)


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def log_single_rank(log: logging.Logger, *args, rank: int = 0, **kwargs) -> None:
    """``log.log(*args)`` on global rank ``rank`` only (every process when there is no group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == rank:
        log.log(*args, **kwargs)


def load_index_cache(path: str, what: str = "dataset index cache file") -> numpy.ndarray:
    """A cached index array, memory-mapped; ValueError naming the file where it is missing (rank 0
    builds it first) or unreadable."""
    if not os.path.isfile(path):
        raise ValueError(f"the {what} {path!r} is missing; rank 0 builds it first")
    try:
        return numpy.load(path, allow_pickle=True, mmap_mode="r")
    except Exception as e:  # a truncated or overwritten file fails in numpy's header, pickle or mmap
        raise ValueError(
            f"the {what} {path!r} is corrupt or truncated ({type(e).__name__}: {e}); expected a NumPy .npy "
            "array: delete it and the next run rebuilds the cache"
        ) from None


def compile_helpers() -> None:
    """Kept for Megatron-LM's training scripts, which call it: the index builders are part of the
    compiled extension, so there is nothing to compile."""


def normalize(weights: list[float]) -> list[float]:
    """``weights`` divided by their sum (a positive number: raises ValueError otherwise)."""
    w = numpy.array(weights, dtype=numpy.float64)
    total = numpy.sum(w)
    if not numpy.isfinite(total) or total <= 0:
        raise ValueError(f"weights {list(weights)} must sum to a positive finite number")
    return (w / total).tolist()


def get_blend_from_list(blend: list[str] | None) -> tuple[list[str], list[float] | None] | None:
    """The (prefixes, weights) blend of a command line list: either prefixes only
    (``["a", "b"]``, weights None) or weight and prefix pairs (``["30", "a", "70", "b"]``).
    An even-length list whose every other entry is not a number is taken as prefixes only."""
    if blend is None:
        return None
    if len(blend) % 2 == 1:
        return [p.strip() for p in blend], None
    raw_weights, raw_prefixes = blend[0::2], blend[1::2]
    weights = []
    for raw in raw_weights:
        try:
            weights.append(float(raw))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return [p.strip() for p in blend], None
    if any(w is None for w in weights):
        bad = [raw for raw, w in zip(raw_weights, weights) if w is None]
        raise ValueError(
            f"the blend {blend} mixes weights and prefixes: {bad} stand where weights are expected "
            "(give 'W1 PREFIX1 W2 PREFIX2 ...' or prefixes only)"
        )
    return [p.strip() for p in raw_prefixes], weights


def check_blend_weights(prefixes: list[str], weights: list[float] | None, what: str = "blend") -> None:
    """Raises ValueError unless ``weights`` is None or pairs with ``prefixes``, every weight a
    finite positive number (as BlendedDataset needs)."""
    if weights is None:
        return
    if len(weights) != len(prefixes):
        raise ValueError(
            f"the {what} has {len(weights)} weights for {len(prefixes)} prefixes; they must pair up"
        )
    for prefix, weight in zip(prefixes, weights):
        if not (weight > 0 and numpy.isfinite(weight)):
            raise ValueError(f"the {what} weight {weight} of {prefix!r} must be a finite number > 0")
