"""Stage predicates and neighbour ranks of a pipeline group, with Megatron-core's names
(``megatron.core.pipeline_parallel.utils``), for model code that is handed its groups instead of
reading parallel_state."""

from __future__ import annotations

import torch.distributed as dist

from megatron_ext.resolve import group_rank as _rank
from megatron_ext.resolve import group_size as _size


def is_pp_first_stage(pp_group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is the first stage of ``pp_group``."""
    return _rank(pp_group) == 0


def is_pp_last_stage(pp_group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is the last stage of ``pp_group``."""
    return _rank(pp_group) == _size(pp_group) - 1


def _check_vp(vp_stage: int | None, vp_size: int | None) -> bool:
    """True when there are virtual stages; without them vp_stage must be None or 0."""
    if vp_size is None or vp_size <= 1:
        if vp_stage not in (None, 0):
            raise ValueError(
                f"vp_stage must be None or 0 without virtual stages (vp_size {vp_size}), got {vp_stage}"
            )
        return False
    return True


def is_vp_first_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """Whether ``vp_stage`` is this rank's first model chunk (always, without virtual stages)."""
    return not _check_vp(vp_stage, vp_size) or vp_stage == 0


def is_vp_last_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """Whether ``vp_stage`` is this rank's last model chunk (always, without virtual stages)."""
    return not _check_vp(vp_stage, vp_size) or vp_stage == vp_size - 1


def get_pp_first_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[0]


def get_pp_last_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the last stage of ``pp_group``."""
    return dist.get_process_group_ranks(pp_group)[-1]


def get_pp_next_rank(pp_group: dist.ProcessGroup) -> int | None:
    """Global rank of the next stage, None on the last."""
    if is_pp_last_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[_rank(pp_group) + 1]


def get_pp_prev_rank(pp_group: dist.ProcessGroup) -> int | None:
    """Global rank of the previous stage, None on the first."""
    if is_pp_first_stage(pp_group):
        return None
    return dist.get_process_group_ranks(pp_group)[_rank(pp_group) - 1]
