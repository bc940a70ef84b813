"""Training checkpoints that load at any tensor/pipeline/context/data-parallel layout, atomic and
verified.

A checkpoint is a directory ``<save>/iter_XXXXXXX`` written by ``serialization.save`` (Megatron-
core's ``torch_dist`` format) plus ``checkpoint.json``, the completion marker (format, iteration,
the layout it was saved at, the model's configuration, caller metadata such as the data position,
and the SHA-256 of every file). ``<save>/latest_checkpointed_iteration.txt`` names the newest
complete one. What is stored is one sharded state dict:

- ``model`` (``model0``, ``model1``, ... with several chunks): each chunk's ``sharded_state_dict()``,
  so every tensor is its global tensor under Megatron-core's key;
- ``optimizer``: ``param_state_by_name()``, each tensor sharded as its parameter under
  ``optimizer.state.<state name>.<parameter key>`` (whatever the optimizer: plain or distributed,
  so either loads the other's), and in the common part the step and fp16 loss scaler;
- ``rng_state``: each rank's random states, an object shard at (pp rank, tp rank, dp x cp rank).

Context-parallel ranks hold the same parameters and optimizer state (replicas, as data-parallel
ranks are), so a checkpoint saved at one cp size loads at any other.

Atomicity: ranks write into ``<save>/.tmp.iter_XXXXXXX``; only after every rank's files are
written and hashed does rank 0 write the marker and rename the directory into place, then update
the tracker file (each by a rename followed by an fsync of the directory). A rank that dies before
that leaves a temporary directory that nothing loads (the next save removes it), and the previous
checkpoint stays what the tracker names. Re-saving an iteration swaps the two directories in one
``renameat2(RENAME_EXCHANGE)``, so the tracker never names a missing directory. A save that fails
(a full disk) removes what it wrote and raises the same error on every rank.

A save never moves the tracker backwards or overwrites a newer checkpoint unless asked
(``overwrite=True``), never writes a NaN or an infinity; ``keep_last`` prunes after a save.

Loading checks, on every rank and before any tensor is read, that the marker exists, that the
files' hashes match, that the model's configuration is the saved one, and that the stored tensors
are exactly the model's (keys and global shapes) and the optimizer's; the outcome is shared over
the world group so every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron_ext import parallel_state
from megatron_ext.distributed.finalize_model_grads import _find_ddp
from megatron_ext.dist_checkpointing import serialization
from megatron_ext.dist_checkpointing.core import (
    _FAILURES,
    CheckpointingException,
    CheckpointWriteError,
    _agree,
    _all_gather,
    _describe,
)
from megatron_ext.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron_ext.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    apply_factories,
)
from megatron_ext.dist_checkpointing.optimizer import make_sharded_optimizer_tensor, sharded_params_by_tensor
from megatron_ext.dist_checkpointing.sharding import model_chunks, stored_shape
from megatron_ext.optimizer.optimizer import chunk_prefix
from megatron_ext.resolve import strip_wrapper_prefix as _strip_wrappers
from megatron_ext.resolve import unwrap_model as _unwrap
from megatron_ext.tensor_parallel.random import get_cuda_rng_tracker
from megatron_ext.training.checkpoint_config import check_config, model_config
from megatron_ext.training.finite_state import refuse_nonfinite
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict

FORMAT = "megatron_ext.dist_checkpointing/2"
FORMAT_1 = "megatron_ext.dist_checkpointing/1"  # the earlier format: see convert.upgrade
_OPTIMIZER_PREFIX = "optimizer.state."  # + "<state name>.<parameter key>"
MARKER = "checkpoint.json"
TRACKER = "latest_checkpointed_iteration.txt"

# Called on every rank after its files are written and before the checkpoint is completed; tests
# set it to kill a rank at the worst moment.
_after_rank_wrote: Callable[[], None] | None = None


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def _tracked_iteration(save_dir: str) -> int | None:
    """The iteration the tracker file of ``save_dir`` names, None without one."""
    tracker = os.path.join(save_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointingException(f"{tracker}: expected an iteration number, found {text!r}") from None


def complete_iterations(save_dir: str) -> list[int]:
    """The iterations of the complete checkpoints (with a marker) in ``save_dir``, ascending."""
    if not os.path.isdir(save_dir):
        return []
    found = (re.fullmatch(r"iter_(\d+)", name) for name in os.listdir(save_dir))
    return sorted(
        int(m.group(1)) for m in found if m and os.path.isfile(os.path.join(save_dir, m.group(0), MARKER))
    )


def latest_iteration(save_dir: str) -> int | None:
    """The newest iteration ``save_dir`` holds: the tracker's, or without a tracker the newest
    complete checkpoint's; None when it holds none. A complete checkpoint newer than the tracker
    is the leftover of a save that died before updating it and does not count."""
    tracked = _tracked_iteration(save_dir)
    if tracked is not None:
        return tracked
    complete = complete_iterations(save_dir)
    return complete[-1] if complete else None


def find_checkpoint(path: str) -> str | None:
    """``path`` itself if it is a checkpoint (complete or not), else the one its tracker file
    names, else None."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return path
    unfinished = os.path.basename(os.path.normpath(path)).startswith(".tmp.iter_")
    if os.path.isdir(path) and (unfinished or any(n == ".metadata" or n.endswith(".distcp")
                                                  for n in os.listdir(path))):
        return path  # written by a save that did not finish: loading says so
    if not os.path.isdir(path):
        return None
    iteration = _tracked_iteration(path)
    return None if iteration is None else checkpoint_dir(path, iteration)


def _layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def _rng_object(states: Any = None) -> ShardedObject:
    """This rank's random states as the object shard (pp rank, tp rank, dp x cp rank) of
    ``rng_state``: every rank keeps its own (at cp 1 the third index is the dp rank)."""
    return ShardedObject(
        "rng_state",
        states,
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        ),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
         parallel_state.get_data_parallel_rank(with_context_parallel=True)),
    )


def _rng_states() -> dict[str, Any]:
    states = {"tracker": get_cuda_rng_tracker().get_states(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng(states: dict[str, Any]) -> None:
    get_cuda_rng_tracker().set_states(states["tracker"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _sharded_model(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, ShardedStateDict]:
    """Each chunk's ``sharded_state_dict()`` (wrappers such as DDP removed) under ``model``, or
    ``model0``, ``model1``, ... with several chunks; a module without one: its tensors by name."""
    chunks = model_chunks(model)
    out = {}
    for i, chunk in enumerate(chunks):
        inner = _unwrap(chunk)
        sharded = getattr(inner, "sharded_state_dict", None)
        out["model" if len(chunks) == 1 else f"model{i}"] = (
            sharded() if sharded is not None else module_sharded_state_dict(inner)
        )
    return out


def _sharded_param_state(
    model: torch.nn.Module | list[torch.nn.Module],
    model_state: dict[str, ShardedStateDict],
    param_state: dict[str, dict[str, torch.Tensor]],
) -> dict[str, dict[str, Any]]:
    """``param_state`` (``optimizer.param_state_by_name()``: per parameter name, tensors of the
    parameter's local shape) sharded as the model's ShardedTensor of each parameter, under the
    keys ``optimizer.state.<name in the entry>.<parameter's key>``."""
    by_tensor = sharded_params_by_tensor(model_state)
    params: dict[str, torch.nn.Parameter] = {}
    chunks = model_chunks(model)
    for i, chunk in enumerate(chunks):
        prefix = chunk_prefix(i, len(chunks))
        for name, param in chunk.named_parameters():
            params[prefix + name] = param
            params.setdefault(prefix + _strip_wrappers(name), param)
    out = {}
    for name, entry in param_state.items():
        sharded = by_tensor.get(id(params.get(name)))
        if sharded is None:
            raise ValueError(
                f"the optimizer names a parameter {name!r} that the model's sharded state dict does not hold"
            )
        out[name] = {
            k: make_sharded_optimizer_tensor(sharded, v, _OPTIMIZER_PREFIX + k) for k, v in entry.items()
        }
    return out


def _without_local_copies(tree: dict[str, Any], seen: dict, copies: list) -> None:
    """Removes (in place) the ShardedTensors of ``tree`` whose shard this rank already requests
    elsewhere (the tied output weight held by the embedding's rank, ZB-V's V layout), recording
    (copy, original) for after the load: DCP takes each shard once per rank."""
    for k, v in list(tree.items()):
        if isinstance(v, dict):
            _without_local_copies(v, seen, copies)
        elif isinstance(v, ShardedTensor):
            where = (v.key, tuple(v.global_offset))
            if where in seen:
                copies.append((v.data, seen[where]))
                del tree[k]
            else:
                seen[where] = v.data


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _hash_my_share(directory: str, names: list[str]) -> dict[str, str]:
    """Each rank hashes every world_size-th file, so large checkpoints hash in parallel."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: _sha256(os.path.join(directory, name)) for name in names[rank::world]}


def _finish_param_gathers(model: torch.nn.Module | list[torch.nn.Module]) -> None:
    """Waits for the parameter all-gathers a distributed optimizer left in flight
    (``overlap_param_gather``): a save must read, and a load must not be overwritten by, them.
    Fully sharded parameters are gathered whole until ``_reshard``."""
    for chunk in model_chunks(model):
        ddp = _find_ddp(chunk)
        if ddp is not None:
            ddp.finish_param_sync()
            if hasattr(ddp, "gather_all_params"):
                ddp.gather_all_params()


def _reshard(model: torch.nn.Module | list[torch.nn.Module], write_back: bool) -> None:
    """Frees what ``_finish_param_gathers`` gathered of fully sharded parameters; ``write_back``
    (after a load) first takes each rank's shard from the loaded values."""
    for chunk in model_chunks(model):
        ddp = _find_ddp(chunk)
        if ddp is not None and hasattr(ddp, "reshard_params"):
            ddp.reshard_params(write_back=write_back)


@contextlib.contextmanager
def gathered_params(model: torch.nn.Module | list[torch.nn.Module]) -> Iterator[None]:
    """The model's whole parameters while inside (a fully sharded model's are freed after each
    use): for reading them, as a save or an export does."""
    _finish_param_gathers(model)
    try:
        yield
    finally:
        _reshard(model, write_back=False)


def _fsync_dir(path: str) -> None:
    """Makes the renames and creations inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: torch.nn.Module | list[torch.nn.Module],
    optimizer: Any = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    keep_last: int | None = None,
) -> str:
    """Saves parameters, optimizer state, RNG states, the model's configuration and ``metadata``
    (JSON: e.g. the data position) as ``<save_dir>/iter_<iteration>``; collective over the world
    group. Returns the checkpoint's directory.

    Refuses (on every rank, before writing) when ``save_dir`` already holds a newer iteration,
    whose checkpoint the save would overwrite and whose tracker it would move back, unless
    ``overwrite``. ``keep_last``: afterwards, remove all but the newest ``keep_last`` complete
    checkpoints (never the one the tracker names). A failed save (e.g. a full disk) removes its
    temporary directory, leaves the previous checkpoints as they were and raises the same
    :class:`CheckpointingException` on every rank."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    with gathered_params(model):
        return _save(save_dir, iteration, model, optimizer, metadata, overwrite, keep_last)


def _save(save_dir: str, iteration: int, model: Any, optimizer: Any, metadata: dict[str, Any] | None,
          overwrite: bool, keep_last: int | None) -> str:
    final = checkpoint_dir(save_dir, iteration)
    param_state = optimizer.param_state_by_name() if optimizer is not None else {}
    newest = _newest_left(save_dir) if dist.get_rank() == 0 else None
    refuse_nonfinite(model, param_state, f"cannot save checkpoint {final!r}: ", newest)
    state: dict[str, Any] = _sharded_model(model)
    if optimizer is not None:
        optimizer_state = optimizer.state_dict()
        state["optimizer"] = {
            "step": int(optimizer_state["step"]),
            "param_state": _sharded_param_state(model, state, param_state),
        }
        if optimizer_state.get("grad_scaler"):  # fp16 loss scaling: the same on every rank
            state["optimizer"]["grad_scaler"] = optimizer_state["grad_scaler"]
    state["rng_state"] = _rng_object(_rng_states())

    tmp = os.path.join(save_dir, f".tmp.iter_{iteration:07d}")
    failed = f"cannot save checkpoint {final!r}: "
    rank0 = dist.get_rank() == 0
    error = None
    if rank0:
        try:
            newest = latest_iteration(save_dir)
            if newest is not None and newest > iteration and not overwrite:
                raise CheckpointingException(
                    f"{save_dir!r} already holds iteration {newest}, newer than {iteration}; saving would "
                    f"overwrite newer checkpoints and move the tracker back (overwrite=True allows it)"
                )
            os.makedirs(save_dir, exist_ok=True)
            for name in os.listdir(save_dir):  # left by saves that died
                if name.startswith(".tmp.iter_") or name.endswith(".old"):
                    shutil.rmtree(os.path.join(save_dir, name))
            os.makedirs(tmp)
        except _FAILURES as e:  # every rank must learn of it
            error = _describe(e)
    _agree(error, failed)

    # Write, then hash: each step's errors are shared, so every rank takes the same path.
    error, results = None, []
    for step in ("write", "hash"):
        try:
            if step == "write":
                serialization.save(state, tmp)
                if _after_rank_wrote is not None:
                    _after_rank_wrote()
                outcome = None
            else:  # every rank's files (and rank 0's .metadata) are written
                outcome = _hash_my_share(tmp, sorted(os.listdir(tmp)))
        except CheckpointWriteError as e:  # raised on every rank; rank 0's names what failed
            error, outcome = (_describe(e) if rank0 else None), None
        except _FAILURES as e:
            error, outcome = _describe(e), None
        results = _all_gather((error, outcome))
        if any(e for e, _ in results):
            break
    error = None
    if rank0:
        try:
            errors = sorted({e for e, _ in results if e})
            if errors:
                raise CheckpointingException("; ".join(errors))
            all_hashes = {name: digest for _, share in results for name, digest in share.items()}
            _commit(save_dir, tmp, final, iteration, metadata, all_hashes, model_config(model))
        except _FAILURES as e:
            shutil.rmtree(tmp, ignore_errors=True)  # what this save wrote, so a full disk frees up
            error = f"{_describe(e)} (removed {tmp!r}; {_newest_left(save_dir)})"
    _agree(error, failed)

    if keep_last is not None:
        error = None
        if rank0:
            try:
                prune_checkpoints(save_dir, keep_last)
            except _FAILURES as e:
                error = _describe(e)
        _agree(error, f"saved checkpoint {final!r} but could not remove older ones: ")
    return final


def _newest_left(save_dir: str) -> str:
    try:
        previous = latest_iteration(save_dir)
    except CheckpointingException as e:
        return str(e)
    if previous is None:
        return "no checkpoint was saved before"
    return f"iteration {previous} is still the newest checkpoint"


def _commit(
    save_dir: str,
    tmp: str,
    final: str,
    iteration: int,
    metadata: dict[str, Any] | None,
    hashes: dict[str, str],
    model_config: dict[str, Any] | None,
) -> None:
    """Rank 0 completes a written checkpoint: marker, directory in place, tracker; each durable."""
    marker = {
        "format": FORMAT,
        "iteration": iteration,
        "layout": _layout(),
        "model_config": model_config,
        "metadata": metadata or {},
        "files": hashes,
    }
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _replace_dir(tmp, final)
    _fsync_dir(save_dir)
    _write_tracker(save_dir, iteration)


def prune_checkpoints(save_dir: str, keep_last: int) -> list[int]:
    """Removes the complete checkpoints of ``save_dir`` but the newest ``keep_last`` and the one
    the tracker names; returns the removed iterations."""
    complete = complete_iterations(save_dir)
    keep = set(complete[-keep_last:]) | {_tracked_iteration(save_dir)}
    removed = [i for i in complete if i not in keep]
    for i in removed:
        shutil.rmtree(checkpoint_dir(save_dir, i))
    if removed:
        _fsync_dir(save_dir)
    return removed


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swaps directories ``a`` and ``b`` atomically (Linux ``renameat2``); False where the
    system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a)


def _replace_dir(src: str, dst: str) -> None:
    """Puts directory ``src`` in the place of ``dst``. An existing ``dst`` is swapped out in one
    step where the file system can, so a tracker naming it never names a missing directory."""
    if not os.path.exists(dst):
        os.replace(src, dst)
        return
    if _exchange(src, dst):
        shutil.rmtree(src)  # now the old checkpoint
        return
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old)


def _write_tracker(save_dir: str, iteration: int) -> None:
    tmp = os.path.join(save_dir, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    _fsync_dir(save_dir)


def read_marker(path: str, expected: str = FORMAT) -> dict[str, Any]:
    """The completion marker of checkpoint ``path``; raises if it is missing, unreadable or of
    another format than ``expected``."""
    marker_path = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        raise CheckpointingException(f"checkpoint {path!r} does not exist")
    if not os.path.isfile(marker_path):
        raise CheckpointingException(
            f"checkpoint {path!r} is incomplete: it has no {MARKER} (a save that did not finish?)"
        )
    try:
        with open(marker_path) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"checkpoint {path!r}: {MARKER} is unreadable ({e})") from None
    if marker.get("format") != expected:
        upgrade = (
            f" (stored by megatron_ext's names, one tensor per layer; `python -m "
            f"megatron_ext.training.convert upgrade {path} NEW_DIR` rewrites it)"
            if marker.get("format") == FORMAT_1 and expected == FORMAT
            else ""
        )
        raise CheckpointingException(
            f"checkpoint {path!r}: format {marker.get('format')!r}, expected {expected!r}{upgrade}"
        )
    return marker


def verify_files(path: str, marker: dict[str, Any], names: list[str]) -> list[str]:
    """Problems with the listed files of checkpoint ``path`` (missing, changed)."""
    problems = []
    for name in names:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            problems.append(f"file {name} is missing")
        elif _sha256(full) != marker["files"][name]:
            problems.append(f"file {name} is corrupted (its SHA-256 differs from the one recorded at save)")
    return problems


def _requested_tensors(state: dict[str, Any]) -> list[ShardedTensor]:
    """The ShardedTensors a load of ``state`` reads (factories built, on a copy)."""
    request, _ = extract_matching_values(state, lambda v: True)
    apply_factories(request)
    return [v for v in nested_values(request) if isinstance(v, ShardedTensor)]


def _check_tensors(stored: dict[str, Any], requested: list[ShardedTensor], all_keys: set[str]) -> list[str]:
    """Problems between the checkpoint's tensors (DCP metadata) and those this rank requests;
    ``all_keys``: every rank's requested keys."""
    problems = []
    for sh in requested:
        what = "optimizer state" if sh.key.startswith(_OPTIMIZER_PREFIX) else "parameter"
        if sh.key not in stored:
            if what == "parameter":
                problems.append(f"parameter {sh.key} {list(sh.global_shape)} is not in the checkpoint")
        elif stored_shape(stored[sh.key]) != tuple(sh.global_shape):
            problems.append(
                f"{what} {sh.key} has global shape {list(stored_shape(stored[sh.key]) or [])} in the "
                f"checkpoint but {list(sh.global_shape)} in the model"
            )
    model_keys = {k for k, md in stored.items() if stored_shape(md) and not k.startswith(_OPTIMIZER_PREFIX)}
    extra = sorted(model_keys - all_keys)
    if extra:
        problems.append(
            f"the checkpoint has parameters the model lacks: {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    return problems


def _check_optimizer(stored: dict[str, Any], requested: list[ShardedTensor]) -> list[str]:
    """The optimizer's state names per parameter against the checkpoint's."""

    def by_param(keys: Any) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for key in keys:
            if key.startswith(_OPTIMIZER_PREFIX):
                name, _, param_key = key[len(_OPTIMIZER_PREFIX) :].partition(".")
                out.setdefault(param_key, []).append(name)
        return out

    held = by_param(stored)
    if not held:
        return ["it holds no optimizer state"]
    return [
        f"the optimizer state of {param_key} holds {sorted(held.get(param_key, []))} in the checkpoint, "
        f"the optimizer has {sorted(names)}"
        for param_key, names in by_param({sh.key for sh in requested}).items()
        if sorted(held.get(param_key, [])) != sorted(names)
    ]


def load_checkpoint(
    path: str,
    model: torch.nn.Module | list[torch.nn.Module],
    optimizer: Any = None,
    load_rng: bool = True,
) -> dict[str, Any]:
    """Loads checkpoint ``path`` (a checkpoint directory, or a save directory whose tracker names
    one) into ``model`` and ``optimizer`` at the current layout; collective over the world group.

    RNG states are restored when the layout is the one the checkpoint was saved at (otherwise
    there is no rank to take them from, and the current states are kept). Returns the marker:
    ``iteration``, ``layout``, ``metadata`` and whether the RNG states were restored (``rng_loaded``).
    Raises :class:`CheckpointingException` on every rank if anything does not fit.
    """
    resolved = find_checkpoint(path)
    _finish_param_gathers(model)
    state: dict[str, Any] = _sharded_model(model)
    targets: dict[str, dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    marker: dict[str, Any] = {}
    stored: dict[str, Any] = {}
    try:
        if resolved is None:
            raise CheckpointingException(f"{path!r} is neither a checkpoint nor a directory with {TRACKER}")
        marker = read_marker(resolved)
        problems += check_config(marker.get("model_config"), model_config(model))
        problems += verify_files(
            resolved, marker, sorted(marker["files"])[dist.get_rank() :: dist.get_world_size()]
        )
        if not problems:
            stored = FileSystemReader(resolved).read_metadata().state_dict_metadata
    except CheckpointingException as e:
        problems.append(str(e))
    except Exception as e:  # noqa: BLE001  (an unreadable file must fail every rank alike)
        problems.append(f"{type(e).__name__}: {e}")
    if optimizer is not None:
        # Targets in the stored dtypes (a 16-bit model's main copies and state are float32).
        current = optimizer.param_state_by_name()
        keys = _sharded_param_state(model, state, current)
        for name, entry in current.items():
            targets[name] = {}
            for k, now in entry.items():
                md = stored.get(keys[name][k].key)
                dtype = md.properties.dtype if stored_shape(md) else now.dtype
                targets[name][k] = torch.empty(now.shape, dtype=dtype, device=now.device)
        state["optimizer"] = {"param_state": _sharded_param_state(model, state, targets)}
    requested = _requested_tensors(state)
    all_keys = set().union(*_all_gather({sh.key for sh in requested}))
    if stored:
        problems += _check_tensors(stored, requested, all_keys)
        if optimizer is not None:
            problems += _check_optimizer(stored, requested)
    reports = _all_gather(problems)
    failed = [(rank, p) for rank, ps in enumerate(reports) for p in ps]
    if failed:
        # The configuration's differences first (the cause), then at most 8 of their effects.
        is_config = lambda p: p.startswith("the checkpoint was saved with")  # noqa: E731
        lines = sorted({p for _, p in failed}, key=lambda p: (not is_config(p), p))
        config_lines = sum(map(is_config, lines))
        shown = config_lines + 8
        more = f"; and {len(lines) - shown} more" if len(lines) > shown else ""
        _reshard(model, write_back=False)
        raise CheckpointingException(
            f"cannot load checkpoint {resolved or path!r}: " + "; ".join(lines[:shown]) + more
        )

    # (a checkpoint written before its layout recorded cp is cp 1)
    rng_loaded = load_rng and {"cp": 1, **marker["layout"]} == _layout()
    if rng_loaded:
        state["rng_state"] = _rng_object()
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    _without_local_copies(state, {}, copies)
    loaded = serialization.load(state, resolved)
    with torch.no_grad():
        for copy, original in copies:
            copy.copy_(original)
    _reshard(model, write_back=True)
    if optimizer is not None:
        scalars = {"step": loaded["optimizer"]["step"]}
        if "grad_scaler" in loaded["optimizer"]:
            scalars["grad_scaler"] = loaded["optimizer"]["grad_scaler"]
        optimizer.load_state_dict(scalars)
        optimizer.load_param_state_by_name(targets)
    if rng_loaded:
        _set_rng(loaded["rng_state"])
    return {**marker, "rng_loaded": rng_loaded, "path": resolved}
