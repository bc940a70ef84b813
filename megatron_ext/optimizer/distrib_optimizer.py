"""Megatron-core's distributed optimizer (ZeRO-1): main parameters and optimizer state sharded
over the data-parallel group.

Every model chunk is wrapped in a ``DistributedDataParallel`` built with
``DistributedDataParallelConfig(use_distributed_optimizer=True)``: its gradient buckets are flat
buffers padded to a multiple of the data-parallel size ``dp``, and data-parallel rank r owns the
r-th of ``dp`` equal slices of each bucket. The backward reduce-scatters every bucket (overlapped
with the backward when ``overlap_grad_reduce``), so rank r receives exactly the averaged
gradients of its slice. This rank's slots are the pieces of parameters that fall into its slices;
each has a main parameter (a float32 copy for 16-bit parameters, else a view of the parameter
itself) and optimizer state of the piece's size only. After the update each rank writes its
pieces into the model parameters and every chunk's ``DistributedDataParallel.start_param_sync()``
all-gathers the buckets' slices: at once, or, with ``DistributedDataParallelConfig.overlap_param_gather``,
left in flight for the forward pre-hooks of the next forward to wait for.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext._torch_compat import all_gather_single
from megatron_ext.comm_errors import reported
from megatron_ext.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.distributed.param_and_grad_buffer import SIXTEEN_BIT
from megatron_ext.optimizer.grad_scaler import MegatronGradScaler
from megatron_ext.optimizer.optimizer import (
    CHECKPOINT_FULLY_RESHARDABLE_FORMATS,
    MixedPrecisionOptimizer,
    _Slot,
    build_torch_optimizer,
    copy_into_model_params,
    named_model_parameters,
)
from megatron_ext.optimizer.optimizer_config import OptimizerConfig
from megatron_ext.resolve import find_wrapper


def _ddp_of(chunk: torch.nn.Module, index: int):
    ddp = find_wrapper(chunk, DistributedDataParallel)
    if ddp is None or ddp.ddp_config is None or not ddp.ddp_config.use_distributed_optimizer:
        raise ValueError(
            f"the distributed optimizer needs model chunk {index} ({type(chunk).__name__}) wrapped in "
            "megatron_ext.distributed.DistributedDataParallel with "
            "DistributedDataParallelConfig(use_distributed_optimizer=True)"
        )
    return ddp


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Shards main parameters and optimizer state over the data-parallel group.

    ``DistributedOptimizer.create(config, model_chunks, grad_scaler)`` builds it (the torch
    optimizer included); ``get_megatron_optimizer`` calls that when
    ``config.use_distributed_optimizer``. The gradient norm and the inf/NaN check reduce over the
    data-parallel group (each gradient element lives on one data-parallel rank) and then over the
    model-parallel group.

    ``sharded_state_dict`` (Megatron-core's checkpointing API) stores the state in *model space*:
    per parameter, its main copy and optimizer state gathered over the data-parallel group and
    shaped like the parameter, sharded as the model's ShardedTensor of it (saved by the
    parameter's main replica, data-parallel rank 0), so a checkpoint loads at any (tp, pp, dp).
    """

    # The sharding types whose checkpoints load at another (tp, pp) (Megatron-core's name).
    checkpoint_fully_reshardable_formats = CHECKPOINT_FULLY_RESHARDABLE_FORMATS
    _STATE_KEY_OF_PARAM = {"fully_reshardable": "param", "fully_sharded_model_space": "fp32_param"}

    @classmethod
    def create(
        cls,
        config: OptimizerConfig,
        model_chunks: list[torch.nn.Module],
        grad_scaler: MegatronGradScaler | None,
        param_groups: list[dict[str, Any]],
    ) -> DistributedOptimizer:
        names = {id(p): n for n, p in named_model_parameters(model_chunks)}
        slots: list[_Slot] = []
        buckets = []  # (ddp, bucket)
        for i, chunk in enumerate(model_chunks):
            ddp = _ddp_of(chunk, i)
            ddp.finish_param_sync()  # the main parameters start from the gathered values
            for bucket in ddp.grad_buckets:
                buckets.append((ddp, bucket))
                lo, hi = ddp.shard_range(bucket)
                param_shard, grad_shard = ddp.param_shard(bucket), ddp.grad_shard(bucket)
                for p in bucket.params_list:
                    offset = bucket.param_to_index[p][0]
                    a, b = max(offset, lo), min(offset + p.numel(), hi)
                    if a >= b:
                        continue
                    # The shard's piece: a view of the parameter itself, except under fully
                    # sharded parameters, whose shards have storage of their own.
                    piece = param_shard[a - lo : b - lo]
                    main = piece.float().clone() if p.dtype in SIXTEEN_BIT else piece
                    grad = grad_shard[a - lo : b - lo]
                    slots.append(_Slot(names[id(p)], p, a - offset, b - offset, main, lambda g=grad: g,
                                       model_piece=piece))
        torch_optimizer = build_torch_optimizer(config, slots, param_groups)
        optimizer = cls(torch_optimizer, config, grad_scaler, slots, model_chunks)
        optimizer._buckets = buckets
        # The slices are those of the data-parallel group within one distributed-optimizer
        # instance (the whole data-parallel group with one instance).
        optimizer._data_parallel_group = _ddp_of(model_chunks[0], 0).intra_dp_cp_group
        return optimizer

    def get_grad_stats_parallel_group(self) -> list[dist.ProcessGroup]:
        return [self._data_parallel_group, self._model_parallel_group()]

    def get_expert_grad_stats_parallel_group(self) -> list[dist.ProcessGroup]:
        expert_dp = _ddp_of(self.model_chunks[0], 0).intra_expt_dp_group
        return [expert_dp, *super().get_expert_grad_stats_parallel_group()]

    def _found_inf_groups(self) -> list[dist.ProcessGroup]:
        return self.get_grad_stats_parallel_group()  # the data-parallel group is among them

    def _ddps(self) -> list:
        return list({id(ddp): ddp for ddp, _ in self._buckets}.values())

    def _finish_param_sync(self) -> None:
        for ddp in self._ddps():
            ddp.finish_param_sync()

    def _copy_main_params_to_model_params(self, force_sync: bool = False) -> None:
        """Writes this rank's updated pieces into the model parameters and starts the
        all-gather of every bucket (left in flight under ``overlap_param_gather`` unless
        ``force_sync``)."""
        with torch.no_grad():
            copy_into_model_params([  # where the main parameter is not a view of the model's
                (s.piece(), s.main) for s in self._slots if s.main.dtype != s.model_param.dtype
            ])
        for ddp in self._ddps():
            ddp.start_param_sync(force_sync=force_sync)

    def _sync_model_params_from_main(self) -> None:
        self._finish_param_sync()
        self._copy_main_params_to_model_params(force_sync=True)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        # A gather still in flight (parameters no forward used) would later overwrite this update.
        self._finish_param_sync()
        return super().step()

    def _gather_flat(self, key: str) -> dict[int, torch.Tensor]:
        """Per model parameter, its full ``key`` tensor (``param`` or an optimizer state),
        assembled from every data-parallel rank's slices."""
        slots_by_param: dict[int, list[_Slot]] = {}
        for s in self._slots:
            slots_by_param.setdefault(id(s.model_param), []).append(s)
        out = {}
        for ddp, bucket in self._buckets:
            sixteen = any(p.dtype in SIXTEEN_BIT for p in bucket.params_list)
            main_dtype = torch.float32 if sixteen else bucket.params_list[0].dtype
            lo, hi = ddp.shard_range(bucket)
            mine = torch.zeros(hi - lo, dtype=main_dtype, device=bucket.device)
            for p in bucket.params_list:
                offset = bucket.param_to_index[p][0]
                for s in slots_by_param.get(id(p), ()):
                    value = s.main if key == "param" else self._slot_state(s, key)
                    mine[offset + s.start - lo : offset + s.end - lo].copy_(value.detach())
            full = torch.empty(bucket.padded_numel, dtype=main_dtype, device=bucket.device)
            what = f"all-gather of the optimizer's {key} of {bucket.describe()}"
            group = ddp.bucket_data_parallel_group(bucket)
            with reported(what, group, tensor=mine):
                all_gather_single(full, mine, group=group)
            for p in bucket.params_list:
                offset = bucket.param_to_index[p][0]
                out[id(p)] = full[offset : offset + p.numel()].view_as(p).clone()
        return out

    def param_state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """As the plain optimizers', gathered over the data-parallel group (a collective: every
        data-parallel rank must call it)."""
        gathered = {key: self._gather_flat(key) for key in ("param",) + self._state_keys}
        names = named_model_parameters(self.model_chunks)
        return {name: {key: gathered[key][id(p)] for key in gathered} for name, p in names}

    def _check_param_state(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        # Every parameter, not only those with a slice here, so all ranks agree on the error.
        for name, p in named_model_parameters(self.model_chunks):
            if name not in d:
                raise ValueError(f"optimizer state is missing parameter {name!r}")
            for key in ("param",) + self._state_keys:
                if key not in d[name] or tuple(d[name][key].shape) != tuple(p.shape):
                    got = tuple(d[name][key].shape) if key in d[name] else None
                    raise ValueError(
                        f"optimizer state {name!r}[{key!r}] has shape {got}, the parameter {tuple(p.shape)}"
                    )

    def load_param_state_by_name(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        self._finish_param_sync()  # a gather in flight would overwrite the loaded values
        super().load_param_state_by_name(d)
        sharded = [ddp for ddp in self._ddps() if getattr(ddp, "params_are_sharded", False)]
        for ddp in sharded:  # the shards are loaded; gathered copies are stale
            ddp.start_param_sync(force_sync=True)
        if sharded:
            return
        with torch.no_grad():  # the parameters without a slice on this rank
            for name, p in named_model_parameters(self.model_chunks):
                p.copy_(d[name]["param"])

    # Megatron-core's checkpointing API -------------------------------------------------------------

    def sharded_state_dict(
        self,
        model_sharded_state_dict: dict,
        is_loading: bool = False,
        sharding_type: str | None = None,
        metadata: dict | None = None,
    ) -> dict[str, Any]:
        """``{"optimizer": {"param_groups": [settings and "step", no parameters]}, "grad_scaler",
        "param_state": {index: {<main>, "exp_avg", "exp_avg_sq"}}, "param_state_sharding_type"}``
        as Megatron-core's; ``param_state`` holds, per trainable parameter (in
        ``named_model_parameters`` order), the whole main copy and state of this rank's part of
        it, sharded as the model's ShardedTensor of the parameter (key
        ``optimizer.state.<main or state>.<parameter key>``, the parameter's replica ids).

        ``sharding_type`` (deprecated in Megatron-core) or ``metadata["distrib_optim_sharding_type"]``:
        ``"fully_sharded_model_space"`` (the default; main copy ``fp32_param``) or
        ``"fully_reshardable"`` (main copy ``param``). Both gather over the data-parallel group
        when saving (a collective) and store the same model-space tensors; Megatron-core's
        ``fully_sharded_model_space`` would have every data-parallel rank write its flat range
        instead, which needs ``ShardedTensor.flattened_range`` (unsupported here and in
        Megatron-core 0.16). Other types (``dp_reshardable``, ``dp_zero_gather_scatter``,
        ``fsdp_dtensor``, ...) raise ValueError. ``is_loading``: a request for
        ``dist_checkpointing.load`` (nothing gathered), whose result ``load_state_dict`` takes."""
        if sharding_type is None:
            sharding_type = (metadata or {}).get("distrib_optim_sharding_type", "fully_sharded_model_space")
        self._check_sharding_type(sharding_type)
        sharded = self._sharded_params(model_sharded_state_dict)
        named = named_model_parameters(self.model_chunks)
        if is_loading:
            state = {
                name: {
                    key: torch.empty(p.shape, dtype=torch.float32 if p.dtype in SIXTEEN_BIT else p.dtype)
                    for key in ("param",) + self._state_keys
                }
                for name, p in named
            }
        else:
            state = self.param_state_by_name()
        main_key = self._STATE_KEY_OF_PARAM[sharding_type]
        param_state = {}
        for index, (name, _) in enumerate(named):
            param_state[index] = {
                (main_key if key == "param" else key): make_sharded_optimizer_tensor(
                    sharded[name], value, f"optimizer.state.{main_key if key == 'param' else key}"
                )
                for key, value in state[name].items()
            }
        groups = [
            {**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "step": self._steps}
            for g in self.optimizer.param_groups
        ]
        sd: dict[str, Any] = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        sd["param_state"] = param_state
        sd["param_state_sharding_type"] = sharding_type
        return sd

    def _check_sharding_type(self, sharding_type: Any) -> None:
        if sharding_type not in self._STATE_KEY_OF_PARAM:
            raise ValueError(
                f"DistributedOptimizer: sharding_type {sharding_type!r} is not supported by megatron_ext; "
                f"expected one of {sorted(self._STATE_KEY_OF_PARAM)}"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also takes ``sharded_state_dict()``'s output once loaded: the groups' settings, the
        step, the grad scaler, then each rank's slices of the model-space state (and the
        parameters from the main copies)."""
        if "param_state" not in state_dict:
            super().load_state_dict(state_dict)
            return
        sharding_type = state_dict.get("param_state_sharding_type")
        self._check_sharding_type(sharding_type)
        groups = state_dict["optimizer"]["param_groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} parameter groups, this optimizer "
                f"{len(self.optimizer.param_groups)}"
            )
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "step")})
        self._steps = int(groups[0].get("step", 0)) if groups else 0
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        main_key = self._STATE_KEY_OF_PARAM[sharding_type]
        named = named_model_parameters(self.model_chunks)
        if len(state_dict["param_state"]) != len(named):
            raise ValueError(
                f"param_state holds {len(state_dict['param_state'])} parameters, this optimizer "
                f"{len(named)}"
            )
        by_name = {
            name: {("param" if k == main_key else k): v for k, v in state_dict["param_state"][i].items()}
            for i, (name, _) in enumerate(named)
        }
        self.load_param_state_by_name(by_name)
