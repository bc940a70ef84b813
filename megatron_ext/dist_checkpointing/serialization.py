"""``save`` / ``load`` of sharded state dicts in Megatron-core's ``torch_dist`` format.

A checkpoint directory holds, as Megatron-core 0.16 writes it:

- ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1,
  "common_backend": "torch", "common_backend_version": 1}``, written last (a directory without it
  is not a checkpoint);
- ``common.pt``: ``torch.save`` of everything in the state dict that is not sharded, by rank 0;
- ``torch.distributed.checkpoint`` (DCP) files: every ShardedTensor key a global tensor whose
  chunks are the main replicas' local tensors at their global offsets (with the prepended axes of
  length 1 kept); every ShardedObject a bytes entry ``<key>/shard_<offset>_<shape>`` holding
  ``torch.save([data])``.

Tensors reach DCP through the same aliases (``sharding.sharded_parts``) as ``save_checkpoint``'s
parameters, so both kinds of checkpoint are written and resharded by one path. Loading reads, for
each requested shard, whatever overlaps it in the stored chunks: any (tp, pp, dp) layout loads a
checkpoint saved at any other.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron_ext.dist_checkpointing.core import (
    _FAILURES,
    CheckpointingException,
    _agree,
    _describe,
)
from megatron_ext.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
    merge,
    nested_values,
)
from megatron_ext.dist_checkpointing.sharding import dcp_state
from megatron_ext.dist_checkpointing.mapping import (
    CommonStateDict,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from megatron_ext.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_ext.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from megatron_ext.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)

CONFIG_FNAME = "metadata.json"
COMMON_STATE_FNAME = "common.pt"
BACKEND = ("torch_dist", 1)
_CONTENT_METADATA_KEY = "content_metadata"


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def _save_strategy(strategy: Any) -> SaveShardedStrategy:
    """A save strategy as given (an object or a ``(backend, version)`` tuple; None: the default,
    looked up at each call)."""
    if strategy is None:
        return get_default_save_sharded_strategy()
    if isinstance(strategy, SaveShardedStrategy):
        return strategy
    if isinstance(strategy, (tuple, list)):
        return get_default_strategy(StrategyAction.SAVE_SHARDED, *strategy)
    raise ValueError(
        f"sharded_strategy must be None, a SaveShardedStrategy or (backend, version), got {strategy!r}"
    )


def _check_strategy(strategy: Any, what: str) -> None:
    """Only Megatron-core's defaults: ``torch_dist`` (v1) for tensors, ``torch`` for common."""
    if isinstance(strategy, (LoadShardedStrategy, SaveCommonStrategy)) or (
        what == "sharded" and isinstance(strategy, SaveShardedStrategy)
    ):
        return
    allowed = {"sharded": [None, BACKEND, ("torch_dist",)], "common": [None, ("torch", 1), ("torch",)]}[what]
    if (tuple(strategy) if isinstance(strategy, (tuple, list)) else strategy) not in allowed:
        raise ValueError(
            f"{what}_strategy {strategy!r} is not supported: megatron_ext writes and reads the "
            f"{'torch_dist' if what == 'sharded' else 'torch'} backend only (pass None)"
        )


def _read_config(checkpoint_dir: str) -> dict:
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    if not os.path.isfile(path):
        raise CheckpointingException(
            f"{checkpoint_dir} is not a distributed checkpoint (it has no {CONFIG_FNAME})"
        )
    with open(path) as f:
        config = json.load(f)
    if config.get("sharded_backend") != "torch_dist" or config.get("common_backend", "torch") != "torch":
        raise CheckpointingException(
            f"{checkpoint_dir}: sharded backend {config.get('sharded_backend')!r} / common backend "
            f"{config.get('common_backend')!r}; megatron_ext reads 'torch_dist' / 'torch' only"
        )
    return config


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, CONFIG_FNAME))


def _sharded_leaves(sharded_state_dict: ShardedStateDict) -> list[ShardedBase]:
    return [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedBase)]


def _save_common(common_state_dict: StateDict, checkpoint_dir: str) -> None:
    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
            if os.listdir(checkpoint_dir):
                logger.warning("Overwriting old incomplete / corrupted checkpoint...")
            # Through a Python file, so a failed write's OSError (errno and all) reaches the message.
            with open(os.path.join(checkpoint_dir, COMMON_STATE_FNAME), "wb") as stream:
                torch.save(common_state_dict, stream)
        except _FAILURES as e:
            error = _describe(e)
    _agree(error, f"cannot save checkpoint {checkpoint_dir!r}: ")


def _finalize(checkpoint_dir: str) -> None:
    """Completes the checkpoint: rank 0 writes ``metadata.json``; collective."""
    error = None
    if dist.get_rank() == 0:
        try:
            write_config(checkpoint_dir)
        except _FAILURES as e:  # every rank raises it, none waits for rank 0 in vain
            error = _describe(e)
    _agree(error, f"cannot save checkpoint {checkpoint_dir!r}: ")


def write_config(checkpoint_dir: str) -> None:
    """Writes ``metadata.json``, the backends the checkpoint was written with."""
    config = {
        "sharded_backend": BACKEND[0],
        "sharded_backend_version": BACKEND[1],
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    with open(os.path.join(checkpoint_dir, CONFIG_FNAME), "w") as f:
        json.dump(config, f)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
    content_metadata: dict | None = None,
) -> AsyncRequest | None:
    """Saves ``sharded_state_dict`` into ``checkpoint_dir``; collective over the world group.

    Factories are built, ``LocalNonpersistentObject`` dropped, the rest that is not sharded goes to
    ``common.pt`` (rank 0's), the main replicas of the shards to DCP's files, then rank 0 writes
    ``metadata.json``. ``validate_access_integrity``: first check that the ranks' main replicas
    cover every tensor exactly once (``validate_sharding_integrity``).
    ``sharded_strategy``: None (``get_default_save_sharded_strategy()``), a ``torch_dist``
    strategy object (``TorchDistSaveShardedStrategy``: its ``thread_count``, files per rank) or
    ``(backend, version)``.
    ``async_sharded_save``: return an :class:`AsyncRequest` at once; the shards are copied at the
    call (training may change the tensors) and written by the request's ``async_fn`` (in a
    background thread once ``AsyncCallsQueue.schedule_async_request`` runs it); the checkpoint is
    complete after its finalization (``maybe_finalize_async_calls``, or ``execute_sync()``) on
    every rank. Errors are raised as the same :class:`CheckpointingException` on every rank; a
    failed write as :class:`CheckpointWriteError`, which is also DCP's ``CheckpointException``.
    """
    strategy = _save_strategy(sharded_strategy)
    _check_strategy(common_strategy, "common")
    checkpoint_dir = str(checkpoint_dir)
    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    apply_factories(sharded_state_dict)
    _, persistent = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )
    sharded_part, common_state_dict = extract_matching_values(
        persistent, lambda v: isinstance(v, ShardedBase)
    )
    for sh in _sharded_leaves(sharded_part):
        if isinstance(sh, ShardedTensor) and sh.data is None:
            raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
    if validate_access_integrity:
        if preprocess_common_before_consistancy_check is not None:
            preprocess_common_before_consistancy_check(common_state_dict)
        validate_sharding_integrity(determine_global_metadata(sharded_part)[1])
    _save_common(common_state_dict, checkpoint_dir)
    if not async_sharded_save:
        strategy.save(sharded_part, checkpoint_dir)
        _finalize(checkpoint_dir)
        return None
    if not hasattr(strategy, "async_save"):
        raise CheckpointingException(f"Cannot apply async_save to non-async strategy {strategy}")
    request = strategy.async_save(sharded_part, checkpoint_dir)
    request.finalize_fns.append(lambda: _finalize(checkpoint_dir))
    return request


def load_common_state_dict(checkpoint_dir: str) -> StateDict:
    """The common (not sharded) part of the checkpoint, ``common.pt``."""
    checkpoint_dir = str(checkpoint_dir)
    _read_config(checkpoint_dir)
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    if not os.path.isfile(path):
        raise CheckpointingException(f"Common file {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


def _stored(checkpoint_dir: str):
    return FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata


def load_tensors_metadata(checkpoint_dir: str, sharded_strategy: Any = None) -> dict[str, ShardedTensor]:
    """Each stored tensor as a ShardedTensor without data (its key, dtype and global shape)."""
    _check_strategy(sharded_strategy, "sharded")
    _read_config(str(checkpoint_dir))
    return {
        k: ShardedTensor.from_rank_offsets(
            k, torch.empty(md.size, dtype=md.properties.dtype, device="meta")
        ).without_data()
        for k, md in _stored(str(checkpoint_dir)).items()
        if isinstance(md, TensorStorageMetadata)
    }


def load_sharded_metadata(
    checkpoint_dir: str, sharded_strategy: Any = None, common_strategy: Any = None
) -> dict[str, ShardedBase]:
    """``load_tensors_metadata`` and each stored ShardedObject shard (without data)."""
    out: dict[str, ShardedBase] = {}
    for k, md in _stored(str(checkpoint_dir)).items():
        if isinstance(md, BytesStorageMetadata) and "/shard_" in k:
            sh = ShardedObject.empty_from_unique_key(k)
            out[sh.unique_key] = sh
    out.update(load_tensors_metadata(checkpoint_dir, sharded_strategy))
    return out


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """Every stored tensor whole, by key (on every rank)."""
    return load(load_tensors_metadata(checkpoint_dir), checkpoint_dir, validate_access_integrity=False)


def load_content_metadata(
    checkpoint_dir: str | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


def _mismatches(shards: list[ShardedBase], stored: dict, strict: StrictHandling) -> tuple[set[str], set[str]]:
    """(missing, unexpected) keys: stored but requested by no rank / requested here but not stored."""
    ckpt_keys = {
        ShardedObject.empty_from_unique_key(k).key
        if isinstance(md, BytesStorageMetadata) and "/shard_" in k
        else k
        for k, md in stored.items()
    }
    unexpected = {sh.key for sh in shards} - ckpt_keys
    missing: set[str] = set()
    if strict in (
        StrictHandling.LOG_ALL,
        StrictHandling.RAISE_ALL,
        StrictHandling.RETURN_ALL,
        StrictHandling.IGNORE_ALL,
    ):
        requested: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(requested, {sh.key for sh in shards})
        missing = ckpt_keys - set().union(*requested)
    return missing, unexpected


def _shape_problems(shards: list[ShardedBase], stored: dict) -> list[str]:
    problems = []
    for sh in shards:
        if isinstance(sh, ShardedObject):
            if sh.unique_key not in stored:
                problems.append(f"object shard {sh.unique_key} is not in the checkpoint")
            continue
        md = stored.get(sh.key)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"tensor {sh.key} is not in the checkpoint")
        elif tuple(md.size) != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
            problems.append(
                f"Global shape mismatch for loaded ({list(md.size)}) and expected ({list(sh.global_shape)}) "
                f"tensor for key {sh.key}"
            )
    return sorted(set(problems))


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Loads what ``sharded_state_dict`` asks for from ``checkpoint_dir``; collective.

    Returns the common state dict with the requested entries put in: each ShardedTensor as its
    ``data`` (filled in place; allocated on the CPU where None), each ShardedObject as its object,
    each factory merged, each ``LocalNonpersistentObject`` unwrapped. ``strict`` (Megatron's
    ``StrictHandling``): the ``*_UNEXPECTED`` / ``*_ALL`` values log, raise or return (as a third
    and second element: ``(state_dict, missing_keys, unexpected_keys)``) the keys the request and
    the checkpoint do not share, leaving unexpected ones out of the load. A stored global shape
    that differs from the requested one (without ``allow_shape_mismatch``) or a missing key is
    refused before any tensor is read, with the same :class:`CheckpointingException` on every rank.
    """
    _check_strategy(sharded_strategy, "sharded")
    _check_strategy(common_strategy, "common")
    checkpoint_dir = str(checkpoint_dir)
    strict = parse_strict_flag(strict)
    error, common, stored = None, {}, {}
    try:
        common = load_common_state_dict(checkpoint_dir)
        stored = _stored(checkpoint_dir)
    except _FAILURES as e:
        error = _describe(e)
    _agree(error, f"cannot load checkpoint {checkpoint_dir!r}: ")

    request, _ = extract_matching_values(sharded_state_dict, lambda v: True)  # a copy of the structure
    factories, _ = extract_matching_values(
        request, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(request)
    nonpersistent, request = extract_matching_values(
        request, lambda v: isinstance(v, LocalNonpersistentObject)
    )
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    merge(common, nonpersistent)
    request, _ = extract_matching_values(request, lambda v: isinstance(v, ShardedBase))
    shards = _sharded_leaves(request)

    missing: set[str] = set()
    unexpected: set[str] = set()
    if strict != StrictHandling.ASSUME_OK_UNEXPECTED:
        missing, unexpected = _mismatches(shards, stored, strict)
        if unexpected:
            request, _ = extract_matching_values(request, lambda v: v.key not in unexpected)
            shards = _sharded_leaves(request)
        message = (
            f"checkpoint {checkpoint_dir!r}: keys in the checkpoint that no rank requested: "
            f"{sorted(missing)}; "
            f"requested keys not in the checkpoint: {sorted(unexpected)}"
        )
        raising = strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)
        # every rank raises (the unexpected keys are per rank): none is left waiting for the others
        _agree(message if (missing or unexpected) and raising else None, "")
        if (missing or unexpected) and strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            logger.warning(message)
    if validate_access_integrity:
        validate_sharding_integrity(determine_global_metadata(request)[1])
    problems = _shape_problems(shards, stored)
    _agree("; ".join(problems) or None, f"cannot load checkpoint {checkpoint_dir!r}: ")

    for sh in shards:
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
            elif sh.allow_shape_mismatch:
                sh.data.zero_()
    stored_shapes = {
        sh.key: tuple(stored[sh.key].size)
        for sh in shards
        if isinstance(sh, ShardedTensor) and sh.allow_shape_mismatch
    }
    state = dcp_state(shards, stored_shapes, loading=True)
    error = None
    try:
        dcp.load(state, storage_reader=FileSystemReader(checkpoint_dir), planner=DefaultLoadPlanner())
    except _FAILURES as e:
        error = _describe(e)
    _agree(error, f"cannot load checkpoint {checkpoint_dir!r}: ")

    objects_seen: dict[str, int] = defaultdict(int)

    def loaded(sh: Any) -> Any:
        if isinstance(sh, ShardedTensor):
            return sh.data
        if isinstance(sh, ShardedObject):
            values = state[sh.unique_key]
            i = objects_seen[sh.unique_key]
            objects_seen[sh.unique_key] += 1
            return values[i] if i < len(values) else values[0]
        return sh

    dict_list_map_inplace(loaded, request)
    merge(common, request)
    apply_factory_merges(common, factories)
    if strict in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL):
        return common, missing, unexpected
    return common
