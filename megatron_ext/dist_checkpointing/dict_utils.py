"""Walking nested dicts and lists (Megatron-core's ``dist_checkpointing.dict_utils`` names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def nested_values(x: Any) -> Iterator[Any]:
    """The leaves of nested dicts and lists."""
    values = x.values() if isinstance(x, dict) else x
    for v in values:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Any) -> Iterator[tuple[Any, Any]]:
    """(key, leaf) of nested dicts and lists, the key within the innermost container."""
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Replaces every leaf ``v`` by ``f(v)`` in place; returns ``x`` (``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def extract_matching_values(
    x: Any, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[Any, Any]:
    """Splits nested ``x`` into (the leaves matching ``predicate``, the others), both with
    ``x``'s structure; empty containers are left out. ``return_lists_as_dicts``: lists become
    ``{index: value}`` dicts, so the matching part keeps the indices."""

    def split(v: Any) -> tuple[Any, Any]:
        if isinstance(v, dict):
            matching, other = {}, {}
            for k, item in v.items():
                m, o = split(item)
                if isinstance(item, (dict, list)):
                    if m:
                        matching[k] = m
                    if o:
                        other[k] = o
                elif predicate(item):
                    matching[k] = item
                else:
                    other[k] = item
            return matching, other
        if isinstance(v, list):
            matching_l: list | dict = {} if return_lists_as_dicts else []
            other_l: list = []
            for i, item in enumerate(v):
                m, o = split(item)
                is_container = isinstance(item, (dict, list))
                if (is_container and m) or (not is_container and predicate(item)):
                    if return_lists_as_dicts:
                        matching_l[i] = m if is_container else item
                    else:
                        matching_l.append(m if is_container else item)
                if (is_container and o) or (not is_container and not predicate(item)):
                    other_l.append(o if is_container else item)
            return matching_l, other_l
        return (v, None) if predicate(v) else (None, v)

    if not isinstance(x, (dict, list)):
        raise ValueError(f"extract_matching_values expects a dict or list, got {type(x).__name__}")
    return split(x)


def merge(x1: Any, x2: Any, key: tuple = ()) -> Any:
    """Merges nested ``x2`` into ``x1`` (in place; ``x2`` wins for leaves); returns ``x1``."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"cannot merge lists of length {len(x1)} and {len(x2)} at key {key}")
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    else:
        raise ValueError(f"cannot merge {type(x1).__name__} and {type(x2).__name__} at key {key}")
    return x1


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """(keys only in ``x1``, keys only in ``x2``, ``(key, type1, type2)`` of the leaves that
    differ) of two nested dicts/lists/tuples, keys as tuples of the path. Tensors are equal when
    their shapes, dtypes and every element are."""
    only_left: list = []
    only_right: list = []
    mismatch: list = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        pairs = [(k, x1[k], x2[k]) for k in x1.keys() & x2.keys()]
    elif isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        pairs = list(zip(range(len(x1)), x1, x2))
    else:
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            same = x1.shape == x2.shape and x1.dtype == x2.dtype and torch.equal(x1.cpu(), x2.cpu())
        elif isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
            same = False
        else:
            try:
                same = bool(x1 == x2)
            except (RuntimeError, ValueError):
                same = False
        if not same:
            mismatch.append((prefix, type(x1), type(x2)))
        return only_left, only_right, mismatch
    for k, v1, v2 in pairs:
        left, right, mis = diff(v1, v2, prefix + (k,))
        only_left += left
        only_right += right
        mismatch += mis
    return only_left, only_right, mismatch
