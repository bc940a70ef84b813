"""Converts a sharded checkpoint to one unsharded ``torch.save`` file and back (one process).

    python -m megatron_ext.dist_checkpointing.convert to-torch CHECKPOINT out.pt
    python -m megatron_ext.dist_checkpointing.convert from-torch in.pt CHECKPOINT

The file holds ``{"model": {global name: tensor}, "optimizer": {"step": int, "param_state":
{global name: {"param", "exp_avg", "exp_avg_sq"}}}, "rng": {rank key: bytes}, "checkpoint":
{"format", "iteration", "layout", "metadata"}}``: every tensor whole, named as in the serial model.
``from-torch`` writes a checkpoint (each tensor one chunk) that loads at any layout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_ext.dist_checkpointing.checkpoint import (
    FORMAT,
    MARKER,
    CheckpointingException,
    _sha256,
    find_checkpoint,
    read_marker,
    verify_files,
)


def _nest(flat: dict[str, Any], paths: dict[str, tuple]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested


def to_torch(checkpoint: str, output: str) -> dict[str, Any]:
    """Reads checkpoint ``checkpoint`` whole (after checking it) and writes it to ``output``."""
    path = find_checkpoint(checkpoint) or checkpoint
    marker = read_marker(path)
    problems = verify_files(path, marker, sorted(marker["files"]))
    if problems:
        raise CheckpointingException(f"cannot convert checkpoint {path!r}: " + "; ".join(problems))
    metadata = FileSystemReader(path).read_metadata()
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            flat[fqn] = None  # a pickled object; loading replaces it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=FileSystemReader(path), no_dist=True)
    state = _nest(dict(sorted(flat.items())), metadata.planner_data or {})
    fields = ("format", "iteration", "layout", "model_config", "metadata")
    state["checkpoint"] = {k: marker.get(k) for k in fields}
    torch.save(state, output)
    return state


def from_torch(source: str, checkpoint: str) -> None:
    """Writes the ``to_torch`` file ``source`` as checkpoint directory ``checkpoint``."""
    state = torch.load(source, weights_only=False)
    info = state.pop("checkpoint", None) if isinstance(state, dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT or "model" not in state:
        raise CheckpointingException(
            f"{source!r} is not an unsharded megatron_ext checkpoint "
            f"(a dict with 'model' and 'checkpoint' of format {FORMAT!r})"
        )
    if os.path.exists(checkpoint):
        raise CheckpointingException(f"{checkpoint!r} exists; choose a new directory")
    tmp = checkpoint.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
    marker = {**info, "files": {name: _sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}}
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
    os.replace(tmp, checkpoint)


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
    args = parser.parse_args(argv)
    if args.command == "to-torch":
        state = to_torch(args.checkpoint, args.output)
        print(
            f"{args.output}: {len(state['model'])} parameters, iteration {state['checkpoint']['iteration']}"
        )
    else:
        from_torch(args.source, args.checkpoint)
        print(f"{args.checkpoint}: written")


if __name__ == "__main__":
    try:
        main()
    except CheckpointingException as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
