"""The guard every checkpoint save passes: a state with a NaN or an infinity is never written."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.dist_checkpointing.core import CheckpointingException, _all_gather
from megatron_ext.dist_checkpointing.sharding import model_chunks
from megatron_ext.optimizer.optimizer import named_model_parameters
from megatron_ext.resolve import unwrap_model


def nonfinite_names(model: Any, param_state: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """This rank's parameters (by name) and optimizer states (``optimizer <state> of <name>``, from
    ``param_state_by_name()``) that hold a NaN or an infinity."""
    named = named_model_parameters([unwrap_model(chunk) for chunk in model_chunks(model)])
    named += [(f"optimizer {key} of {name}", tensor)
              for name, entry in param_state.items() for key, tensor in entry.items()]
    return [name for name, tensor in named if not bool(torch.isfinite(tensor).all())]


def refuse_nonfinite(model: Any, param_state: dict[str, dict[str, torch.Tensor]], prefix: str,
                     where_things_stand: str | None) -> None:
    """Raises the same CheckpointingException on every rank when any rank's state is not finite:
    ``prefix``, the ranks with (up to three of) their tensors, then rank 0's
    ``where_things_stand`` (e.g. which checkpoint is still the newest). Collective over the world."""
    bad = nonfinite_names(model, param_state)
    mine = None
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        mine = f"rank {dist.get_rank()}: {', '.join(bad[:3])}{more}"
    shared = _all_gather((mine, where_things_stand if dist.get_rank() == 0 else None))
    errors = sorted({error for error, _ in shared if error})
    if errors:
        raise CheckpointingException(
            f"{prefix}the state is not finite (NaN or Inf in {'; '.join(errors)}); nothing was written, "
            f"{shared[0][1]}"
        )
