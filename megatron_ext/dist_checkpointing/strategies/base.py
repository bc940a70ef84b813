"""Megatron-core's strategy registry (``strategies.base``): ``save`` and ``load`` take a strategy
object or a ``(backend, version)`` tuple; ``get_default_strategy`` answers the defaults
(``torch_dist`` v1 for the shards, ``torch`` v1 for the common state)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from megatron_ext.dist_checkpointing.core import CheckpointingException


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


class SaveStrategyBase:
    """A way of writing a checkpoint, named by its backend and version."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadStrategyBase:
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class SaveCommonStrategy(SaveStrategyBase):
    """The common state goes to ``common.pt`` (``torch`` v1); serialization writes it."""


class LoadCommonStrategy(LoadStrategyBase):
    """Reads ``common.pt``; serialization reads it."""


class SaveShardedStrategy(SaveStrategyBase):
    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        raise NotImplementedError


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A strategy that can return the writing as an AsyncRequest instead of doing it."""

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> Any:
        raise NotImplementedError

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()


class LoadShardedStrategy(LoadStrategyBase):
    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> Any:
        raise NotImplementedError


default_strategies: dict[str, dict[tuple[str, int], Any]] = {a.value: {} for a in StrategyAction}


def register_default_strategy(
    action: StrategyAction, backend: str, version: int, strategy: SaveStrategyBase | LoadStrategyBase
) -> None:
    default_strategies[action.value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The registered strategy for ``action`` at ``(backend, version)``; CheckpointingException
    for any other backend (megatron_ext has ``torch_dist`` v1 and ``torch`` v1, registered when
    ``strategies.torch`` is imported, as the package's ``__init__`` does)."""
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError:
        raise CheckpointingException(
            f"Cannot find a default strategy for: {(action.value, backend, version)}; megatron_ext "
            "has ('torch_dist', 1) for sharded and ('torch', 1) for common state"
        ) from None
