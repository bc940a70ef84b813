"""Converts a ``save_checkpoint`` checkpoint to one unsharded ``torch.save`` file and back (one
process, no process group).

    python -m megatron_ext.training.convert to-torch CHECKPOINT out.pt
    python -m megatron_ext.training.convert from-torch in.pt CHECKPOINT
    python -m megatron_ext.training.convert upgrade OLD_CHECKPOINT CHECKPOINT

The file holds every stored tensor whole, by its key: ``{"model": {key: tensor}, "optimizer":
{"optimizer.state.<state name>.<parameter key>": tensor}, "objects": {stored name: object}
(each rank's random states), "common": the checkpoint's common state (``common.pt``: the
optimizer's step and loss scaler), "checkpoint": {"format", "iteration", "layout",
"model_config", "metadata"}}``. ``from-torch`` writes a checkpoint (each tensor one chunk) that
loads at any layout. ``upgrade`` rewrites a checkpoint of the earlier format (megatron_ext's
names, one tensor per layer) as one of today's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_ext.training.checkpointing import (
    _OPTIMIZER_PREFIX,
    FORMAT,
    FORMAT_1,
    MARKER,
    CheckpointingException,
    _sha256,
    find_checkpoint,
    read_marker,
    verify_files,
)
from megatron_ext.dist_checkpointing.serialization import COMMON_STATE_FNAME, write_config
from megatron_ext.transformer.transformer_layer import megatron_core_name


def _read_whole(checkpoint: str, expected: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(path, marker, every stored entry whole by its DCP name) of checkpoint ``checkpoint``,
    after checking its marker and files."""
    path = find_checkpoint(checkpoint) or checkpoint
    marker = read_marker(path, expected)
    problems = verify_files(path, marker, sorted(marker["files"]))
    if problems:
        raise CheckpointingException(f"cannot convert checkpoint {path!r}: " + "; ".join(problems))
    metadata = FileSystemReader(path).read_metadata()
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        is_tensor = isinstance(md, TensorStorageMetadata)
        flat[key] = torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None  # None: an object
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=FileSystemReader(path), no_dist=True)
    return path, marker, flat


_FIELDS = ("format", "iteration", "layout", "model_config", "metadata")


def to_torch(checkpoint: str, output: str) -> dict[str, Any]:
    """Reads checkpoint ``checkpoint`` whole (after checking it) and writes it to ``output``."""
    if os.path.isdir(output):
        raise CheckpointingException(f"{output!r} is a directory; expected the path of the file to write")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise CheckpointingException(f"cannot write {output!r}: {parent!r} is not a directory")
    path, marker, flat = _read_whole(checkpoint, FORMAT)
    state: dict[str, Any] = {"model": {}, "optimizer": {}, "objects": {}}
    for key in sorted(flat):
        if not isinstance(flat[key], torch.Tensor):
            state["objects"][key] = flat[key]
        else:
            state["optimizer" if key.startswith(_OPTIMIZER_PREFIX) else "model"][key] = flat[key]
    state["common"] = torch.load(os.path.join(path, COMMON_STATE_FNAME), weights_only=False)
    state["checkpoint"] = {k: marker.get(k) for k in _FIELDS}
    torch.save(state, output)
    return state


def from_torch(source: str, checkpoint: str) -> None:
    """Writes the ``to_torch`` file ``source`` as checkpoint directory ``checkpoint``."""
    if not os.path.isfile(source):
        raise CheckpointingException(f"{source!r}: no such file (expected a file written by to-torch)")
    try:
        state = torch.load(source, weights_only=False)
    except Exception as e:  # noqa: BLE001  (pickle, zip and torch errors alike: not a torch.save file)
        raise CheckpointingException(
            f"{source!r} is not a torch.save file written by to-torch ({type(e).__name__}: {e})"
        ) from e
    _write(state, checkpoint, repr(source))


def _write(state: Any, checkpoint: str, source: str) -> None:
    info = state.get("checkpoint") if isinstance(state, dict) else None
    parts = ("model", "optimizer", "objects", "common")
    if not isinstance(info, dict) or info.get("format") != FORMAT or not all(k in state for k in parts):
        raise CheckpointingException(
            f"{source} is not an unsharded megatron_ext checkpoint (a dict with {list(parts)} and "
            f"'checkpoint' of format {FORMAT!r})"
        )
    if os.path.exists(checkpoint):
        raise CheckpointingException(f"{checkpoint!r} exists; choose a new directory")
    tmp = checkpoint.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
    except OSError as e:  # a path under a regular file, a read-only parent
        raise CheckpointingException(f"cannot write {checkpoint!r}: {e}") from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        flat = {**state["model"], **state["optimizer"], **state["objects"]}
        # unflattened, as serialization.save writes: an object entry is stored whole
        planner = DefaultSavePlanner(flatten_state_dict=False)
        dcp.save(flat, storage_writer=FileSystemWriter(tmp), planner=planner, no_dist=True)
    torch.save(state["common"], os.path.join(tmp, COMMON_STATE_FNAME))
    write_config(tmp)
    marker = {**info, "files": {name: _sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}}
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
    os.replace(tmp, checkpoint)


def upgrade(old: str, checkpoint: str) -> None:
    """Rewrites checkpoint ``old`` of the earlier format (``FORMAT_1``: DCP entries
    ``model.<name>``, ``optimizer.param_state.<name>.<state name>``, ``optimizer.step``,
    ``optimizer.grad_scaler`` and ``rng.tp<t>_pp<p>_dp<d>``, named as in the serial model, one
    tensor per layer) as checkpoint directory ``checkpoint`` of today's: the same values under
    Megatron-core's keys, the layers stacked."""
    path, marker, flat = _read_whole(old, FORMAT_1)
    layout = marker["layout"]
    state: dict[str, Any] = {"model": {}, "optimizer": {}, "objects": {}, "common": {"optimizer": {}}}
    layers: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def put(group: str, prefix: str, name: str, tensor: torch.Tensor) -> None:
        key = megatron_core_name(name)
        head, sep, rest = key.partition("decoder.layers.")
        number, _, inner = rest.partition(".")
        if sep and number.isdigit():
            layers.setdefault((group, prefix + head + sep + inner), {})[int(number)] = tensor
        else:
            state[group][prefix + key] = tensor

    for name, value in flat.items():
        if name.startswith("model."):
            put("model", "", name[len("model.") :], value)
        elif name.startswith("optimizer.param_state."):
            param, _, k = name[len("optimizer.param_state.") :].rpartition(".")
            put("optimizer", f"{_OPTIMIZER_PREFIX}{k}.", param, value)
        elif name in ("optimizer.step", "optimizer.grad_scaler"):
            scalar = value if name == "optimizer.step" else torch.load(io.BytesIO(value), weights_only=True)
            state["common"]["optimizer"][name.split(".")[1]] = scalar
        elif re.fullmatch(r"rng\.tp\d+_pp\d+_dp\d+", name):
            tp, pp, dp = map(int, re.findall(r"\d+", name))
            shard = f"rng_state/shard_{pp}.{tp}.{dp}_{layout['pp']}.{layout['tp']}.{layout['dp']}"
            state["objects"][shard] = [torch.load(io.BytesIO(value), weights_only=True)]
        else:
            raise CheckpointingException(f"cannot upgrade checkpoint {path!r}: unexpected entry {name!r}")
    for (group, key), by_number in layers.items():
        if sorted(by_number) != list(range(len(by_number))):
            raise CheckpointingException(
                f"cannot upgrade checkpoint {path!r}: {key} has layers {sorted(by_number)}, "
                f"expected 0 ... {len(by_number) - 1}"
            )
        state[group][key] = torch.stack([by_number[i] for i in range(len(by_number))])
        linear = key.rsplit(".", 1)[0]
        if group == "model" and linear.rsplit(".", 1)[-1].startswith("linear_"):
            # the empty state objects each layer's linear stores (Megatron-core's load asks for them)
            for i in range(len(by_number)):
                state["objects"][f"{linear}._extra_state/shard_{i}_{len(by_number)}"] = [None]
    if not state["common"]["optimizer"]:
        del state["common"]["optimizer"]
    state["checkpoint"] = {**{k: marker.get(k) for k in _FIELDS}, "format": FORMAT}
    _write(state, checkpoint, f"checkpoint {path!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    to = commands.add_parser("to-torch", help="sharded checkpoint -> one torch.save file")
    to.add_argument("checkpoint")
    to.add_argument("output")
    back = commands.add_parser("from-torch", help="torch.save file -> sharded checkpoint directory")
    back.add_argument("source")
    back.add_argument("checkpoint")
    up = commands.add_parser("upgrade", help="checkpoint of the earlier format -> checkpoint of today's")
    up.add_argument("old")
    up.add_argument("checkpoint")
    args = parser.parse_args(argv)
    if args.command == "to-torch":
        state = to_torch(args.checkpoint, args.output)
        print(
            f"{args.output}: {len(state['model'])} model tensors, {len(state['optimizer'])} optimizer "
            f"tensors, iteration {state['checkpoint']['iteration']}"
        )
    elif args.command == "from-torch":
        from_torch(args.source, args.checkpoint)
        print(f"{args.checkpoint}: written")
    else:
        upgrade(args.old, args.checkpoint)
        print(f"{args.checkpoint}: written")


if __name__ == "__main__":
    try:
        main()
    except CheckpointingException as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
