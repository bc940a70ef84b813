"""Megatron-core's optimizer wrappers (``megatron.core.optimizer.optimizer``): a torch optimizer
over *main* parameters, fed from the model's gradients, with loss scaling and clipping by the
global norm over every parallel group.

Each wrapper keeps slots (name, model parameter, element range, main parameter) for a torch
optimizer over the main parameters; ``step()`` copies model gradients (``main_grad`` under a
``DistributedDataParallel`` with a ``ddp_config``, else ``.grad``) into the main ``.grad``,
unscales and checks them (fp16), clips, steps and writes the result back into the model.

* ``FP32Optimizer``: the model parameters are the main parameters.
* ``Float16OptimizerWithFloat16Params``: 16-bit model parameters get float32 main copies.
* ``DistributedOptimizer`` (``distrib_optimizer.py``): each data-parallel rank holds the main
  parameters and optimizer state of its slice of every gradient bucket only.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import reported
from megatron_ext.dist_checkpointing.optimizer import (
    KEEP_VARS_HINT,
    add_prefix_for_sharding,
    local_nonpersistent,
    make_sharded_optimizer_tensor,
    sharded_params_by_tensor,
)
from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    grad_norm_tensor,
    group_by_device_and_dtype,
)
from megatron_ext.optimizer.grad_scaler import MegatronGradScaler
from megatron_ext.optimizer.optimizer_config import OptimizerConfig
from megatron_ext.optimizer.parameters import (  # noqa: F401  (ProxyDict: Megatron-core's name here)
    ProxyDict, _plain_slots, _Slot, _state_dict_params, chunk_prefix, named_model_parameters,
)
from megatron_ext.optimizer.torch_optimizer import (
    _scalar_step,
    _state_keys,
    build_torch_optimizer,
    copy_into_model_params,
)
from megatron_ext.resolve import default_group, find_wrapper
from megatron_ext.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron_ext.tensor_parallel.utils import comm_device


# The distributed optimizer's sharding types whose checkpoints load at any data-parallel layout.
CHECKPOINT_FULLY_RESHARDABLE_FORMATS = frozenset({"fully_reshardable", "fully_sharded_model_space"})


class MegatronOptimizer:
    """The common interface: ``step() -> (update_successful, grad_norm, num_zeros_in_grad)``,
    ``zero_grad``, ``scale_loss``, ``get_loss_scale``, ``state_dict``/``load_state_dict`` and the
    layout-independent ``param_state_by_name``/``load_param_state_by_name``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler | None,
        slots: list[_Slot],
        model_chunks: list[torch.nn.Module],
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.model_chunks = model_chunks
        self.is_stub_optimizer = False
        # Set by get_megatron_optimizer from a pg_collection; None: parallel_state's groups.
        self.model_parallel_group: dist.ProcessGroup | None = None
        self.data_parallel_group: dist.ProcessGroup | None = None
        self.tp_group: dist.ProcessGroup | None = None
        self.expt_tp_group: dist.ProcessGroup | None = None
        self._slots = slots
        # Mixture-of-experts models: the experts' gradient norm is reduced over the expert groups
        # (decided from the model's config, the same on every rank).
        self._has_experts = any(
            getattr(getattr(m, "config", None), "num_moe_experts", None)
            for c in model_chunks
            for m in c.modules()
        )
        self._state_keys = _state_keys(optimizer)
        self._steps = 0  # successful updates: Adam's step count
        if config.fp16 and grad_scaler is None:
            raise ValueError(
                "fp16 training needs a grad scaler (OptimizerConfig.loss_scale or the dynamic one)"
            )

    # Groups over which gradient statistics are reduced -----------------------------------------

    def _model_parallel_group(self) -> dist.ProcessGroup | None:
        return default_group("mp", self.model_parallel_group)

    def get_grad_stats_parallel_group(self) -> list[dist.ProcessGroup]:
        """Gradients are already averaged over data-parallel ranks: the model-parallel group (none
        in a process without torch.distributed, where there is nothing to reduce over)."""
        return [self._model_parallel_group()] if dist.is_initialized() else []

    # Loss scaling ---------------------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return torch.tensor([1.0])
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (``config.grad_scale_func`` of the schedules)."""
        return loss * self.get_loss_scale().to(device=loss.device, dtype=loss.dtype)

    # Parameters and gradients --------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def get_parameters(self) -> list[torch.Tensor]:
        return [s.main for s in self._slots]

    def get_main_grads_for_grad_norm(self, expert: bool = False) -> list[torch.Tensor]:
        """Main gradients counted once across ranks (no tensor-parallel duplicates, judged over the
        etp group for experts; not the last stage's tied-embedding copy): of the dense parameters,
        or with ``expert`` of the expert ones."""
        alone = not dist.is_initialized()  # no process group: no duplicates to skip
        expt_tp = expert and not alone
        tp_group = default_group("expt_tp", self.expt_tp_group, False) if expt_tp else self.tp_group
        return [
            s.main.grad
            for s in self._slots
            if s.main.grad is not None
            and getattr(s.model_param, "allreduce", True) != expert
            and not getattr(s.model_param, "shared", False)
            and (alone or param_is_not_tensor_parallel_duplicate(s.model_param, tp_group))
        ]

    def get_expert_grad_stats_parallel_group(self) -> list[dist.ProcessGroup]:
        """Expert gradients are already averaged over expert-data-parallel ranks: the expert
        tensor × expert × pipeline-parallel group, where each expert shard lives once."""
        return [default_group("tp_ep_pp")] if dist.is_initialized() else []

    def _grad_norm_tensor(self) -> torch.Tensor:
        """The norm of all gradients, each counted once: the dense parameters' over their groups,
        the experts' over theirs."""
        norm = grad_norm_tensor(self.get_main_grads_for_grad_norm(),
                                grad_stats_parallel_group=self.get_grad_stats_parallel_group())
        if not self._has_experts:
            return norm
        experts = grad_norm_tensor(self.get_main_grads_for_grad_norm(expert=True),
                                   grad_stats_parallel_group=self.get_expert_grad_stats_parallel_group())
        return (norm.square() + experts.to(norm.device).square()).sqrt()

    def get_grad_norm(self) -> float:
        return float(self._grad_norm_tensor())

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_main_grads_for_grad_norm(), self.get_grad_stats_parallel_group())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's gradients, the main parameters' and, for model chunks wrapped in a
        ``DistributedDataParallel``, its gradient buffers (``zero_grad_buffer``), which
        Megatron-core's training loop calls separately."""
        for chunk in self.model_chunks:
            ddp = find_wrapper(chunk, DistributedDataParallel)
            if ddp is not None:
                ddp.zero_grad_buffer()
        for s in self._slots:
            for t in (s.main, s.model_param):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.detach().zero_()

    def _copy_model_grads_to_main_grads(self) -> None:
        for s in self._slots:
            grad = s.grad_source()
            if grad is None:
                s.main.grad = None
            elif grad.dtype == s.main.dtype and grad.device == s.main.device:
                # A float32 gradient buffer (or a float32 model's own gradient) is the main
                # gradient itself, as in Megatron-core: no second float32 copy per parameter.
                s.main.grad = grad.detach().view(s.main.shape)
            else:
                s.main.grad = grad.detach().reshape(s.main.shape).to(s.main.dtype)

    def _found_inf_groups(self) -> list[dist.ProcessGroup]:
        """Groups over which the found-inf flag is reduced: every rank holding a copy of a
        parameter, so all copies skip a step alike even where their gradients differ (Megatron-core
        reduces over the model-parallel group only, assuming data-parallel copies agree)."""
        return [default_group("dp_cp", self.data_parallel_group), *self.get_grad_stats_parallel_group()]

    def _unscale_and_check_for_inf(self) -> bool:
        """Divides the main gradients by the loss scale; True if any rank saw an inf or NaN. One
        multi-tensor kernel per (device, dtype) unscales and checks; the host waits once, for the
        reduced flag."""
        groups = self._found_inf_groups()
        found = torch.zeros(1, device=comm_device(*groups))
        grads = [s.main.grad for s in self._slots if s.main.grad is not None]
        for same in group_by_device_and_dtype(grads):
            device = same[0].device
            found_here = torch.zeros(1, device=device)
            inv_scale = self.grad_scaler.inv_scale.to(device=device, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_(same, found_here, inv_scale)
            found = torch.maximum(found, found_here.to(found.device))
        for group in groups:
            with reported("all-reduce (max) of the found-inf flag", group):
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def prepare_grads(self) -> bool:
        """Model gradients -> main gradients (unscaled); True if the step must be skipped."""
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        found_inf = self._unscale_and_check_for_inf()
        self.grad_scaler.update(found_inf)
        return found_inf

    def _copy_main_params_to_model_params(self) -> None:
        with torch.no_grad():
            copy_into_model_params([
                (s.piece(), s.main) for s in self._slots
                if s.main is not s.model_param
            ])

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The update from the prepared main gradients (Megatron-core's second half of
        ``step``): the torch optimizer's step, then main parameters into the model."""
        unset = [i for i, group in enumerate(self.optimizer.param_groups) if group["lr"] is None]
        if unset:
            raise ValueError(
                f"parameter group(s) {unset} have no learning rate: set OptimizerConfig.lr, or each "
                "group's 'lr' (as a learning-rate scheduler does), before step()"
            )
        self.optimizer.step()
        self._steps += 1
        self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """One update. Returns ``(update_successful, grad_norm, num_zeros_in_grad)``: with an
        inf/NaN in the fp16 gradients the update is skipped and ``(False, None, None)``
        returned; ``grad_norm`` is the norm before clipping, computed with clipping off too (as by
        the ``ChainedOptimizer`` that Megatron-core's ``get_megatron_optimizer`` returns, whose norm
        Megatron-LM logs), ``num_zeros_in_grad`` None unless ``log_num_zeros_in_grad``."""
        if self.prepare_grads():
            for s in self._slots:
                s.main.grad = None
            return False, None, None
        # On the device until the update is queued: the host waits once, at the end.
        grad_norm = self._grad_norm_tensor()
        if self.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(self.get_parameters(), self.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        update_successful = self.step_with_ready_grads()
        return update_successful, float(grad_norm), num_zeros

    def reload_model_params(self, state_dict: dict[str, Any] | None = None) -> None:
        """Sets the main parameters from the model parameters (their shards, when fully sharded)
        after they were changed outside the optimizer (e.g. loaded), or from ``state_dict``'s
        tensors (by name, ``module.`` prefixes ignored; several chunks: ``{"model0": ...}``)."""
        sources = _state_dict_params(state_dict, self.model_chunks) if state_dict is not None else {}
        with torch.no_grad():
            for s in self._slots:
                if s.main is s.model_param:
                    continue
                if state_dict is not None and s.name not in sources:
                    raise ValueError(f"reload_model_params: the state_dict has no tensor for {s.name!r}")
                source = sources[s.name] if state_dict is not None else None
                if source is not None and tuple(source.shape) != tuple(s.model_param.shape):
                    raise ValueError(
                        f"reload_model_params: {s.name!r} has shape {tuple(source.shape)} in the state_dict, "
                        f"the parameter {tuple(s.model_param.shape)}"
                    )
                piece = s.piece() if source is None else source.detach().reshape(-1)[s.start : s.end]
                s.main.copy_(piece.detach().reshape(s.main.shape))

    # State ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (layout-dependent for the distributed optimizer): the torch
        optimizer's, the main parameters where they are copies, the grad scaler's and ``step``
        (the number of successful updates)."""
        sd: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "step": self._steps}
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        if any(s.main is not s.model_param for s in self._slots):
            sd["main_params"] = [s.main.detach().clone() for s in self._slots]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes ``state_dict()``'s output, or ``sharded_state_dict()``'s once loaded (by
        ``dist_checkpointing.load``); a dict with ``step`` alone (what a layout-independent
        checkpoint stores beside ``param_state_by_name``) sets the step count only."""
        if "state" in state_dict and "param_groups" in state_dict:  # FP32Optimizer's sharded form
            state_dict = {"optimizer": state_dict}
        if "optimizer" in state_dict:
            optim, common_step = _with_per_param_step(state_dict["optimizer"])
            self.optimizer.load_state_dict(optim)
            if common_step is not None and "step" not in state_dict:
                state_dict = {**state_dict, "step": common_step}
        if "fp32_from_fp16_params" in state_dict:
            self._load_fp32_copies(state_dict["fp32_from_fp16_params"])
        if "main_params" in state_dict:
            mains = state_dict["main_params"]
            if len(mains) != len(self._slots):
                raise ValueError(
                    f"state_dict has {len(mains)} main parameters, this optimizer {len(self._slots)}"
                )
            with torch.no_grad():
                for s, value in zip(self._slots, mains):
                    if tuple(value.shape) != tuple(s.main.shape):
                        raise ValueError(
                            f"main parameter {s.name!r}: shape {tuple(value.shape)} in the state_dict, "
                            f"expected {tuple(s.main.shape)}"
                        )
                    s.main.copy_(value)
            self._sync_model_params_from_main()
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        if "step" in state_dict:
            self._steps = int(state_dict["step"])
            fused = bool(self.optimizer.defaults.get("fused"))
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = _scalar_step(self._steps, state["step"], fused)

    def _sync_model_params_from_main(self) -> None:
        self._copy_main_params_to_model_params()

    # Megatron-core's checkpointing API -------------------------------------------------------------

    def _sharded_params(self, model_sharded_state_dict: dict) -> dict[str, Any]:
        """Each trainable parameter's ShardedTensor (or factory) in the model's sharded state
        dict, by the parameter's name here."""
        by_tensor = sharded_params_by_tensor(model_sharded_state_dict)
        out = {}
        for name, p in named_model_parameters(self.model_chunks):
            if id(p) not in by_tensor:
                raise ValueError(
                    f"parameter {name!r} is not in the model's sharded state dict: {KEEP_VARS_HINT}"
                )
            out[name] = by_tensor[id(p)]
        return out

    def _sharded_torch_state(self, sharded: dict[str, Any]) -> dict[str, Any]:
        """The torch optimizer's state dict with every state tensor sharded as its parameter
        (key ``optimizer.state.<state>.<parameter key>``), the step as ``state["common_step"]``
        and each group's parameter indices local (``LocalNonpersistentObject``), as
        Megatron-core's plain optimizers give it."""
        slot_of = {id(s.main): s for s in self._slots}
        state: dict[Any, Any] = {}
        groups = []
        for group in self.optimizer.param_groups:
            indices = []
            for main in group["params"]:
                s = slot_of[id(main)]
                state[len(state)] = {
                    key: make_sharded_optimizer_tensor(
                        sharded[s.name], self._slot_state(s, key).detach(), f"optimizer.state.{key}"
                    )
                    for key in self._state_keys
                }
                indices.append(len(state) - 1)
            settings = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
            like = next(iter(sharded.values()), None)
            groups.append({**settings, "params": local_nonpersistent(like, indices)})
        if self._has_step:
            state["common_step"] = _scalar_step(self._steps)
        return {"state": state, "param_groups": groups}

    @property
    def _has_step(self) -> bool:
        return self._state_keys != ("momentum_buffer",)

    def _fp32_copy_slots(self) -> list[list[_Slot]]:
        """Per torch group, the slots whose main parameter is a copy (of a 16-bit parameter)."""
        slot_of = {id(s.main): s for s in self._slots}
        groups = [[slot_of[id(main)] for main in group["params"]] for group in self.optimizer.param_groups]
        return [[s for s in group if s.main is not s.model_param] for group in groups]

    def sharded_state_dict(
        self, model_sharded_state_dict: dict, is_loading: bool = False, metadata: dict | None = None
    ) -> dict[str, Any]:
        """Megatron-core's mixed-precision form: ``{"optimizer": <the torch optimizer's state,
        sharded as the parameters>, "fp32_from_fp16_params": [[main copy per 16-bit parameter]
        per group] (keys ``optimizer.state.fp32_param.<parameter key>``), "grad_scaler"}``.
        ``model_sharded_state_dict`` is the model's ``sharded_state_dict()`` (its tensors must be
        the parameters); ``is_loading``: a request for ``dist_checkpointing.load`` (state not yet
        created is requested as zeros), whose result ``load_state_dict`` takes."""
        sharded = self._sharded_params(model_sharded_state_dict)
        sd: dict[str, Any] = {"optimizer": self._sharded_torch_state(sharded)}
        sd["fp32_from_fp16_params"] = [
            [
                make_sharded_optimizer_tensor(sharded[s.name], s.main.detach(), "optimizer.state.fp32_param")
                for s in group
            ]
            for group in self._fp32_copy_slots()
        ]
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

    def _load_fp32_copies(self, loaded: list[list[torch.Tensor]]) -> None:
        groups = self._fp32_copy_slots()
        sizes = [len(g) for g in groups]
        if [len(g) for g in loaded] != sizes:
            raise ValueError(
                f"fp32_from_fp16_params holds {[len(g) for g in loaded]} main copies per group, this "
                f"optimizer {sizes}"
            )
        with torch.no_grad():
            for group, values in zip(groups, loaded):
                for s, value in zip(group, values):
                    if tuple(value.shape) != tuple(s.main.shape):
                        raise ValueError(
                            f"fp32_from_fp16_params: {s.name!r} has shape {tuple(value.shape)}, "
                            f"expected {tuple(s.main.shape)}"
                        )
                    s.main.copy_(value)

    def _slot_state(self, s: _Slot, key: str) -> torch.Tensor:
        state = self.optimizer.state.get(s.main, {})
        value = state.get(key)
        return value if value is not None else torch.zeros_like(s.main)

    def param_state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{name: {"param": main copy, <optimizer state>...}}`` with each tensor shaped like this
        rank's model parameter (Adam: ``exp_avg``, ``exp_avg_sq``; zeros before the first step)."""
        out = {}
        for s in self._slots:
            entry = {"param": s.main.detach().clone().view_as(s.model_param)}
            for key in self._state_keys:
                entry[key] = self._slot_state(s, key).detach().clone().view_as(s.model_param)
            out[s.name] = entry
        return out

    def _check_param_state(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        names = {s.name: s.model_param for s in self._slots}
        missing = sorted(set(names) - set(d))
        if missing:
            more = " ..." if len(missing) > 5 else ""
            raise ValueError(f"optimizer state is missing parameters {missing[:5]}{more}")
        for name, param in names.items():
            for key in ("param",) + self._state_keys:
                if key not in d[name]:
                    raise ValueError(f"optimizer state of {name!r} has no {key!r}")
                if tuple(d[name][key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"optimizer state {name!r}[{key!r}] has shape {tuple(d[name][key].shape)}, "
                        f"the parameter {tuple(param.shape)}"
                    )

    def load_param_state_by_name(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        """Loads ``param_state_by_name()``'s output (from any layout whose local shapes match):
        each rank takes its part; the model parameters are set from ``param``."""
        self._check_param_state(d)
        with torch.no_grad():
            for s in self._slots:
                entry = d[s.name]
                s.main.copy_(entry["param"].reshape(-1)[s.start : s.end].view_as(s.main))
                has_step = self._state_keys != ("momentum_buffer",)
                fused = bool(self.optimizer.defaults.get("fused"))
                state = {"step": _scalar_step(self._steps, s.main, fused)} if has_step else {}
                for key in self._state_keys:
                    piece = entry[key].reshape(-1)[s.start : s.end].view_as(s.main)
                    state[key] = piece.to(s.main.dtype).clone()
                self.optimizer.state[s.main] = state
                s.piece().copy_(entry["param"].reshape(-1)[s.start : s.end])


def _with_per_param_step(optim: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """A torch optimizer state dict from a sharded one whose ``state`` holds one
    ``common_step``: each parameter's state gets it as ``step``; also the step count (None
    without a ``common_step``)."""
    state = optim.get("state", {})
    if "common_step" not in state:
        return optim, None
    step = state["common_step"]
    per_param = {k: {**v, "step": _scalar_step(int(step))} for k, v in state.items() if k != "common_step"}
    return {**optim, "state": per_param}, int(step)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Base of the optimizers whose main parameters may be float32 copies of 16-bit ones."""


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """bf16/fp16 model parameters with float32 main parameters (``Float16OptimizerWithFloat16Params``
    of Megatron-core). ``Float16OptimizerWithFloat16Params.create(config, model_chunks,
    grad_scaler)`` builds the torch optimizer too."""

    @classmethod
    def create(cls, config: OptimizerConfig, model_chunks: list[torch.nn.Module],
               grad_scaler: MegatronGradScaler | None,
               param_groups: list[dict[str, Any]]) -> Float16OptimizerWithFloat16Params:
        slots = _plain_slots(named_model_parameters(model_chunks), copy_16bit=True)
        torch_optimizer = build_torch_optimizer(config, slots, param_groups)
        return cls(torch_optimizer, config, grad_scaler, slots, model_chunks)


class FP32Optimizer(MegatronOptimizer):
    """Model parameters are the main parameters (float32, or float64 in exactness tests)."""

    @classmethod
    def create(cls, config: OptimizerConfig, model_chunks: list[torch.nn.Module],
               param_groups: list[dict[str, Any]]) -> FP32Optimizer:
        slots = _plain_slots(named_model_parameters(model_chunks), copy_16bit=False)
        return cls(build_torch_optimizer(config, slots, param_groups), config, None, slots, model_chunks)

    def sharded_state_dict(
        self, model_sharded_state_dict: dict, is_loading: bool = False, metadata: dict | None = None
    ) -> dict[str, Any]:
        """The torch optimizer's state dict, each state tensor sharded as its parameter (key
        ``optimizer.state.<state>.<parameter key>``), the step as ``state["common_step"]``, as
        Megatron-core's ``FP32Optimizer`` gives it (the parameters are the model's to save)."""
        return self._sharded_torch_state(self._sharded_params(model_sharded_state_dict))


class ChainedOptimizer(MegatronOptimizer):
    """Several optimizers, each over its own parameters, stepped as one (Megatron-core's
    ``ChainedOptimizer``; ``get_megatron_optimizer`` here returns a single optimizer, there being
    no expert parameters to chain). ``param_groups`` concatenates the optimizers' groups (the same
    dicts, so setting a learning rate reaches them), ``state`` is a ``ProxyDict`` over their
    states. ``step()`` checks every optimizer's gradients for inf/NaN first, clips all by one
    global norm (one reduction when the optimizers share their gradient-statistics groups, else
    the root of the summed squares of their norms), then updates each."""

    def __init__(self, chained_optimizers: list[Any]) -> None:  # no MegatronOptimizer state of its own
        self.chained_optimizers = list(chained_optimizers)
        self.model_chunks: list[torch.nn.Module] = []
        self.config = getattr(self.chained_optimizers[0], "config", None) if self.chained_optimizers else None
        for optimizer in self.chained_optimizers:
            for chunk in getattr(optimizer, "model_chunks", []):
                if all(chunk is not c for c in self.model_chunks):
                    self.model_chunks.append(chunk)
            if getattr(optimizer, "config", None) != self.config:
                raise ValueError("ChainedOptimizer: the chained optimizers must share one config")
        self.is_stub_optimizer = all(getattr(o, "is_stub_optimizer", False) for o in self.chained_optimizers)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer, when there is only one chained optimizer."""
        if len(self.chained_optimizers) != 1:
            raise RuntimeError(
                f"ChainedOptimizer.optimizer: there are {len(self.chained_optimizers)} chained optimizers, "
                "not one"
            )
        return self.chained_optimizers[0].optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.chained_optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> ProxyDict:
        return ProxyDict([optimizer.state for optimizer in self.chained_optimizers])

    def get_parameters(self) -> list[torch.Tensor]:
        return [p for optimizer in self.chained_optimizers for p in optimizer.get_parameters()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        if self.chained_optimizers:
            return self.chained_optimizers[0].get_loss_scale()
        return torch.tensor([1.0])

    def reload_model_params(self, state_dict: dict[str, Any] | None = None) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.reload_model_params(state_dict)

    def state_dict(self) -> Any:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def load_state_dict(self, state_dict: Any) -> None:
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if isinstance(state_dict, dict):
            state_dict = [v for _, v in sorted(state_dict.items())]
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(
                f"ChainedOptimizer.load_state_dict: {len(state_dict)} entries for "
                f"{len(self.chained_optimizers)} chained optimizers"
            )
        for optimizer, state in zip(self.chained_optimizers, state_dict):
            optimizer.load_state_dict(state)

    def sharded_state_dict(
        self, model_sharded_state_dict: dict, is_loading: bool = False, **kwargs: Any
    ) -> dict[Any, Any]:
        """One chained optimizer: its own. Several: ``{index: its sharded state dict}``, the keys
        of optimizer ``index``'s tensors prefixed ``chained_<index>.`` unless
        ``metadata["chained_optim_avoid_prefix"]`` (with a fully reshardable
        ``distrib_optim_sharding_type`` or none), as Megatron-core's."""
        if len(self.chained_optimizers) == 1:
            only = self.chained_optimizers[0]
            return only.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        metadata = kwargs.get("metadata") or {}
        kind = metadata.get("distrib_optim_sharding_type")
        reshardable = kind is None or kind in CHECKPOINT_FULLY_RESHARDABLE_FORMATS
        add_prefix = not reshardable or not metadata.get("chained_optim_avoid_prefix", False)
        out = {}
        for index, optimizer in enumerate(self.chained_optimizers):
            sd = optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            if add_prefix:
                add_prefix_for_sharding(sd, f"chained_{index}.")
            out[index] = sd
        return out

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = False
        for optimizer in self.chained_optimizers:
            found_inf |= optimizer.prepare_grads()
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        success = True
        for optimizer in self.chained_optimizers:
            success &= optimizer.step_with_ready_grads()
        return success

    def _groups_shared(self) -> bool:
        reference = self.chained_optimizers[0].get_grad_stats_parallel_group()
        return all(o.get_grad_stats_parallel_group() == reference for o in self.chained_optimizers)

    def get_grad_stats_parallel_group(self) -> list[dist.ProcessGroup]:
        if not self._groups_shared():
            raise RuntimeError("ChainedOptimizer: the chained optimizers reduce gradient statistics over "
                               "different groups")
        return self.chained_optimizers[0].get_grad_stats_parallel_group()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].get_grad_norm()
        if self._groups_shared():
            grads = [g for o in self.chained_optimizers for g in o.get_main_grads_for_grad_norm()]
            return get_grad_norm_fp32(grads, grad_stats_parallel_group=self.get_grad_stats_parallel_group())
        return sum(o.get_grad_norm() ** 2 for o in self.chained_optimizers) ** 0.5

    @torch.no_grad()
    def count_zeros(self) -> int:
        if self._groups_shared():
            grads = [g for o in self.chained_optimizers for g in o.get_main_grads_for_grad_norm()]
            return count_zeros_fp32(grads, self.get_grad_stats_parallel_group())
        return sum(o.count_zeros() for o in self.chained_optimizers)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        if self.prepare_grads():
            for optimizer in self.chained_optimizers:
                for s in optimizer._slots:
                    s.main.grad = None
            return False, None, None
        grad_norm = self.get_grad_norm()
        for optimizer in self.chained_optimizers:
            if optimizer.config.clip_grad > 0.0 and optimizer.get_parameters():
                clip = optimizer.config.clip_grad
                clip_grad_by_total_norm_fp32(optimizer.get_parameters(), clip, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def param_state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for optimizer in self.chained_optimizers:
            out.update(optimizer.param_state_by_name())
        return out

    def load_param_state_by_name(self, d: dict[str, dict[str, torch.Tensor]]) -> None:
        for optimizer in self.chained_optimizers:
            names = {n for n, _ in named_model_parameters(optimizer.model_chunks)}
            optimizer.load_param_state_by_name({k: v for k, v in d.items() if k in names})
