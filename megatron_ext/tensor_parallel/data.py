"""Broadcast of a batch from tensor-parallel rank 0 to the other ranks of its TP group."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import reported
from megatron_ext.tensor_parallel.utils import comm_device, resolve_tp_group

_MAX_DATA_DIM = 8
# Header layout: [status, then per key: ndim, size_0 .. size_7].
_OK, _BAD_DATA = 0, 1


def _source_problem(
    keys: Sequence[str], data: Mapping[str, torch.Tensor] | None, datatype: torch.dtype
) -> str | None:
    """Why the source rank's ``data`` cannot be broadcast, or None if it can."""
    if data is None:
        return "data is None on tensor-parallel rank 0, the source of the broadcast"
    for key in keys:
        if key not in data:
            return f"key {key!r} is missing from data (keys present: {sorted(data)})"
        value = data[key]
        if not isinstance(value, torch.Tensor):
            return f"data[{key!r}] is a {type(value).__name__}, expected a torch.Tensor"
        if value.dtype != datatype:
            return f"data[{key!r}] has dtype {value.dtype}, expected {datatype}"
        if value.dim() > _MAX_DATA_DIM:
            return f"data[{key!r}] has {value.dim()} dims, at most {_MAX_DATA_DIM} are supported"
    return None


def broadcast_data(
    keys: Sequence[str],
    data: Mapping[str, torch.Tensor] | None,
    datatype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Sends ``data[key]`` for every key from TP rank 0 to the whole TP group.

    Only rank 0's ``data`` is read (other ranks may pass ``None``). Shapes are broadcast first,
    then one flat buffer of ``datatype``. Returns ``{key: tensor}`` on every rank, on the device the
    group communicates on (CPU for gloo, the current GPU for NCCL). If rank 0's data is unusable
    (missing key, wrong dtype), every rank raises ``ValueError`` instead of waiting.
    """
    group = resolve_tp_group(tp_group)
    src = dist.get_global_rank(group, 0)
    is_src = dist.get_rank(group) == 0
    device = comm_device(group)
    keys = list(keys)

    header = torch.zeros(1 + len(keys) * (1 + _MAX_DATA_DIM), dtype=torch.long, device=device)
    problem = _source_problem(keys, data, datatype) if is_src else None
    if is_src:
        if problem is not None:
            header[0] = _BAD_DATA
        else:
            for i, key in enumerate(keys):
                shape = data[key].shape
                row = 1 + i * (1 + _MAX_DATA_DIM)
                header[row] = len(shape)
                if shape:
                    header[row + 1 : row + 1 + len(shape)] = torch.tensor(shape, dtype=torch.long)
    with reported("broadcast_data (the shapes)", group, peer=None if is_src else src):
        dist.broadcast(header, src, group=group)
    if header[0].item() != _OK:
        if problem is not None:
            raise ValueError(f"broadcast_data: {problem}")
        raise ValueError(
            "broadcast_data: tensor-parallel rank 0 (the source) rejected its data; see its error"
        )

    header = header.tolist()
    shapes = []
    for i in range(len(keys)):
        row = 1 + i * (1 + _MAX_DATA_DIM)
        shapes.append(torch.Size(header[row + 1 : row + 1 + header[row]]))
    total = sum(shape.numel() for shape in shapes)

    if is_src:
        flat = torch.cat([data[key].contiguous().view(-1).to(device) for key in keys]) if keys else None
        if flat is None:
            flat = torch.empty(0, dtype=datatype, device=device)
    else:
        flat = torch.empty(total, dtype=datatype, device=device)
    with reported("broadcast_data (the data)", group, tensor=flat, peer=None if is_src else src):
        dist.broadcast(flat, src, group=group)

    result: dict[str, torch.Tensor] = {}
    offset = 0
    for key, shape in zip(keys, shapes):
        result[key] = flat.narrow(0, offset, shape.numel()).view(shape)
        offset += shape.numel()
    return result
