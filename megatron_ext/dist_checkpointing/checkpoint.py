"""Saving and loading training state as a resharding ``torch.distributed.checkpoint``.

A checkpoint is a directory ``<save>/iter_XXXXXXX`` holding DCP's files and ``checkpoint.json``,
the completion marker (format, iteration, the layout it was saved at, caller metadata such as the
data position, and the SHA-256 of every file). ``<save>/latest_checkpointed_iteration.txt`` names
the newest complete one.

Atomicity: ranks write into ``<save>/.tmp.iter_XXXXXXX``; only after every rank's files are
written and hashed does rank 0 write the marker and rename the directory into place, then update
the tracker file (each by a rename followed by an fsync of the directory). A rank that dies before
that leaves a temporary directory that nothing loads (the next save removes it), and the previous
checkpoint stays what the tracker names. Re-saving an iteration swaps the two directories in one
``renameat2(RENAME_EXCHANGE)``, so the tracker never names a missing directory. A save that fails
(a full disk) removes what it wrote and raises the same error on every rank.

A save never moves the tracker backwards or overwrites a newer checkpoint unless asked
(``overwrite=True``); ``keep_last`` prunes the older complete checkpoints after a save.

Loading checks, on every rank and before any tensor is read, that the marker exists, that the
files' hashes match, and that the stored parameters are exactly the model's (names and global
shapes); the outcome is shared over the world group so every rank raises the same error.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as _DCPException
from torch.distributed.checkpoint.metadata import Metadata

from megatron_ext import parallel_state
from megatron_ext.comm_errors import reported
from megatron_ext.distributed.finalize_model_grads import _find_ddp
from megatron_ext.dist_checkpointing.core import CheckpointingException
from megatron_ext.dist_checkpointing.sharding import (
    ParamSpec,
    model_chunks,
    param_specs,
    stored_shape,
    unique_specs,
)
from megatron_ext.tensor_parallel.random import get_cuda_rng_tracker

FORMAT = "megatron_ext.dist_checkpointing/1"
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
    if os.path.isdir(path) and any(n == ".metadata" or n.endswith(".distcp") for n in os.listdir(path)):
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
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def _rng_key() -> str:
    return (
        f"tp{parallel_state.get_tensor_model_parallel_rank()}"
        f"_pp{parallel_state.get_pipeline_model_parallel_rank()}"
        f"_dp{parallel_state.get_data_parallel_rank()}"
    )


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _rng_bytes() -> bytes:
    states = {"tracker": get_cuda_rng_tracker().get_states(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return _to_bytes(states)


def _set_rng(data: bytes) -> None:
    states = _from_bytes(data)
    get_cuda_rng_tracker().set_states(states["tracker"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _optimizer_by_global_name(
    optimizer: Any, specs: dict[str, ParamSpec]
) -> dict[str, tuple[str, ParamSpec, dict[str, torch.Tensor]]]:
    """The optimizer's per-parameter state by global name, with its own name and the spec."""
    out = {}
    for name, state in optimizer.param_state_by_name().items():
        if name not in specs:
            raise ValueError(f"the optimizer names a parameter {name!r} that the model does not have")
        if specs[name].copy_of is None:  # a tied copy's state equals its original's
            out[specs[name].global_name] = (name, specs[name], state)
    return out


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
    (``overlap_param_gather``): a save must read, and a load must not be overwritten by, them."""
    for chunk in model_chunks(model):
        ddp = _find_ddp(chunk)
        if ddp is not None:
            ddp.finish_param_sync()


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    with reported("all-gather of the checkpoint's per-rank records", None):
        dist.all_gather_object(out, obj)
    return out


def _model_config(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, Any] | None:
    """The hyperparameters that give the stored tensors their meaning, read from the model's
    ``config`` (a TransformerConfig) and, for a GPTModel, its vocabulary and sequence length;
    None for a model without a config."""
    inner = model_chunks(model)[0]
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module  # DDP and other wrappers
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "num_layers"):
        return None
    activation = getattr(config, "activation_func", None)
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": getattr(config, "num_query_groups", None) or config.num_attention_heads,
        "kv_channels": getattr(config, "kv_channels", None),
        "ffn_hidden_size": getattr(config, "ffn_hidden_size", None),
        "vocab_size": getattr(inner, "vocab_size", None),
        "max_sequence_length": getattr(inner, "max_sequence_length", None),
        "normalization": getattr(config, "normalization", None),
        "activation": getattr(activation, "__name__", repr(activation)),
        "gated_linear_unit": getattr(config, "gated_linear_unit", None),
        "add_bias_linear": getattr(config, "add_bias_linear", None),
        "qk_layernorm": getattr(config, "qk_layernorm", None),
        "rotary_interleaved": getattr(config, "rotary_interleaved", None),
        "position_embedding_type": getattr(inner, "position_embedding_type", None),
        "share_embeddings_and_output_weights": getattr(inner, "share_embeddings_and_output_weights", None),
        "params_dtype": str(getattr(config, "params_dtype", None)).replace("torch.", ""),
    }


# Fields that may differ between the saved and the loading model: the values are converted.
CONVERTIBLE_CONFIG_FIELDS = ("params_dtype",)


def _check_config(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    if saved is None or current is None:  # a checkpoint or a model without a config
        return []
    differ = [
        field
        for field in current
        if field in saved and field not in CONVERTIBLE_CONFIG_FIELDS and saved[field] != current[field]
    ]
    if not differ:
        return []
    return [
        "the checkpoint was saved with " + ", ".join(f"{f}={saved[f]!r}" for f in differ)
        + "; this model has " + ", ".join(f"{f}={current[f]!r}" for f in differ)
    ]


def _fsync_dir(path: str) -> None:
    """Makes the renames and creations inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(error: str | None, prefix: str, exception: type[Exception] = CheckpointingException) -> None:
    """Shares every rank's error (None for none): all ranks raise the same exception or none does."""
    errors = sorted({e for e in _all_gather(error) if e})
    if errors:
        raise exception(prefix + "; ".join(errors))


# What a save's steps may raise: DCP's own exception is a BaseException.
_FAILURES = (Exception, _DCPException)


def _describe(e: BaseException) -> str:
    """One line for an error: DCP's per-rank failures without their tracebacks."""
    if isinstance(e, CheckpointingException):
        return str(e)
    if isinstance(e, _DCPException):
        return "; ".join(f"rank {r}: {_describe(exc)}" for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


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
    _finish_param_gathers(model)
    specs = param_specs(model)
    state: dict[str, Any] = {"model": {s.global_name: s.sharded() for s in unique_specs(specs)}}
    if optimizer is not None:
        param_state = {}
        for global_name, (_, spec, entry) in _optimizer_by_global_name(optimizer, specs).items():
            param_state[global_name] = {k: spec.sharded(v) for k, v in entry.items()}
        optimizer_state = optimizer.state_dict()
        state["optimizer"] = {"step": int(optimizer_state["step"]), "param_state": param_state}
        if optimizer_state.get("grad_scaler"):  # fp16 loss scaling: the same on every rank
            state["optimizer"]["grad_scaler"] = _to_bytes(optimizer_state["grad_scaler"])
    state["rng"] = {_rng_key(): _rng_bytes()}

    final = checkpoint_dir(save_dir, iteration)
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
                dcp.save(state, storage_writer=FileSystemWriter(tmp))
                if _after_rank_wrote is not None:
                    _after_rank_wrote()
                outcome = None
            else:  # every rank's files (and rank 0's .metadata) are written
                outcome = _hash_my_share(tmp, sorted(os.listdir(tmp)))
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
            _commit(save_dir, tmp, final, iteration, metadata, all_hashes, _model_config(model))
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


def read_marker(path: str) -> dict[str, Any]:
    """The completion marker of checkpoint ``path``; raises if it is missing or unreadable."""
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
    if marker.get("format") != FORMAT:
        raise CheckpointingException(
            f"checkpoint {path!r}: format {marker.get('format')!r}, expected {FORMAT!r}"
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


def _stored_optimizer_keys(metadata: Metadata, global_name: str) -> list[str]:
    prefix = f"optimizer.param_state.{global_name}."
    return sorted(k[len(prefix) :] for k in metadata.state_dict_metadata if k.startswith(prefix))


def _check_optimizer(metadata: Metadata, current: dict[str, tuple[str, ParamSpec, dict]]) -> list[str]:
    if "optimizer.step" not in metadata.state_dict_metadata:
        return ["it holds no optimizer state"]
    problems = []
    for global_name, (_, _, entry) in current.items():
        stored = _stored_optimizer_keys(metadata, global_name)
        if stored != sorted(entry):
            problems.append(
                f"the optimizer state of {global_name} holds {stored} in the checkpoint, "
                f"the optimizer has {sorted(entry)}"
            )
    return problems


def _check_model(metadata: Metadata, specs: list[ParamSpec], all_names: set[str]) -> list[str]:
    problems = []
    stored = metadata.state_dict_metadata
    for spec in specs:
        key = f"model.{spec.global_name}"
        expected = tuple(spec.sharded().global_shape)
        if key not in stored:
            problems.append(f"parameter {spec.global_name} {list(expected)} is not in the checkpoint")
        elif stored_shape(stored[key]) != expected:
            problems.append(
                f"parameter {spec.global_name} has global shape "
                f"{list(stored_shape(stored[key]) or [])} in the "
                f"checkpoint but {list(expected)} in the model"
            )
    extra = sorted(
        k[len("model.") :] for k in stored if k.startswith("model.") and k[len("model.") :] not in all_names
    )
    if extra:
        problems.append(
            f"the checkpoint has parameters the model lacks: {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    return problems


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
    specs = param_specs(model)
    unique = unique_specs(specs)
    all_names = set().union(*_all_gather([s.global_name for s in unique]))
    current = _optimizer_by_global_name(optimizer, specs) if optimizer is not None else {}
    problems: list[str] = []
    marker: dict[str, Any] = {}
    metadata: Metadata | None = None
    try:
        if resolved is None:
            raise CheckpointingException(f"{path!r} is neither a checkpoint nor a directory with {TRACKER}")
        marker = read_marker(resolved)
        problems += _check_config(marker.get("model_config"), _model_config(model))
        problems += verify_files(
            resolved, marker, sorted(marker["files"])[dist.get_rank() :: dist.get_world_size()]
        )
        if not problems:
            metadata = FileSystemReader(resolved).read_metadata()
            problems += _check_model(metadata, unique, all_names)
            if optimizer is not None:
                problems += _check_optimizer(metadata, current)
    except CheckpointingException as e:
        problems.append(str(e))
    except Exception as e:  # noqa: BLE001  (an unreadable file must fail every rank alike)
        problems.append(f"{type(e).__name__}: {e}")
    reports = _all_gather(problems)
    failed = [(rank, p) for rank, ps in enumerate(reports) for p in ps]
    if failed:
        # The configuration's differences first (the cause), then at most 8 of their effects.
        is_config = lambda p: p.startswith("the checkpoint was saved with")  # noqa: E731
        lines = sorted({p for _, p in failed}, key=lambda p: (not is_config(p), p))
        config_lines = sum(map(is_config, lines))
        shown = config_lines + 8
        more = f"; and {len(lines) - shown} more" if len(lines) > shown else ""
        raise CheckpointingException(
            f"cannot load checkpoint {resolved or path!r}: " + "; ".join(lines[:shown]) + more
        )
    assert metadata is not None

    state: dict[str, Any] = {"model": {s.global_name: s.sharded() for s in unique}}
    optimizer_targets: dict[str, dict[str, torch.Tensor]] = {}
    if optimizer is not None:
        param_state = {}
        for global_name, (name, spec, entry_now) in current.items():
            entry = {}
            for k, now in entry_now.items():
                dtype = metadata.state_dict_metadata[
                    f"optimizer.param_state.{global_name}.{k}"
                ].properties.dtype
                target = torch.empty(spec.param.shape, dtype=dtype, device=now.device)
                optimizer_targets.setdefault(name, {})[k] = target
                entry[k] = spec.sharded(target)
            param_state[global_name] = entry
        state["optimizer"] = {"step": 0, "param_state": param_state}
        if "optimizer.grad_scaler" in metadata.state_dict_metadata:
            state["optimizer"]["grad_scaler"] = b""
    rng_loaded = load_rng and marker["layout"] == _layout()
    if rng_loaded:
        state["rng"] = {_rng_key(): b""}
    dcp.load(state, storage_reader=FileSystemReader(resolved))
    with torch.no_grad():
        for spec in {id(s): s for s in specs.values() if s.copy_of is not None}.values():
            spec.param.copy_(spec.copy_of.param)
    if optimizer is not None:
        for name in optimizer.param_state_by_name():
            original = specs[name].copy_of
            if original is not None:
                targets = optimizer_targets[current[original.global_name][0]]
                optimizer_targets[name] = {k: v.clone() for k, v in targets.items()}

    if optimizer is not None:
        scalars = {"step": state["optimizer"]["step"]}
        if "grad_scaler" in state["optimizer"]:
            scalars["grad_scaler"] = _from_bytes(state["optimizer"]["grad_scaler"])
        optimizer.load_state_dict(scalars)
        optimizer.load_param_state_by_name(optimizer_targets)
    if rng_loaded:
        _set_rng(state["rng"][_rng_key()])
    return {**marker, "rng_loaded": rng_loaded, "path": resolved}
