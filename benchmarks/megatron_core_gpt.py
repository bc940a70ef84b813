"""Megatron-core 0.16.1's own ``GPTModel`` (its local layer spec) trained the way Megatron-LM's
loop trains it: Megatron-core's DistributedDataParallel on every model chunk,
``get_megatron_optimizer``, ``finalize_model_grads`` and ``get_forward_backward_func``, on CPU
processes joined by gloo. ``tests/test_megatron_core_model.py`` runs it with megatron_ext
underneath (``use_megatron_ext()``) and on Megatron-core alone; ``benchmarks/train_step.py``
times it against megatron_ext's own GPTModel.

megatron_ext never imports megatron-core; only these callers do.

Megatron-core names CUDA devices in code a CPU run reaches. ``cpu_patches(full)`` points them at
the CPU, each patch named here:

- model code (both runs): ``torch.cuda.current_device()`` returns ``"cpu"`` (the rotary
  embedding moves its frequencies there on the first forward), ``Tensor.cuda()`` returns the
  tensor (the tied embedding's first all-reduce across pipeline stages), ``torch.tensor`` ignores
  ``pin_memory=True`` (the rotary embedding's context-parallel index, pinned for its copy to the GPU);
- Megatron-core's own DDP, optimizer and schedules (``full=True``, the Megatron-core-alone run):
  also ``torch.cuda.synchronize`` does nothing, the factory functions given ``device="cuda"``
  allocate on the CPU, and ``Tensor.type()`` of a CPU tensor reports the CUDA name
  (``torch.cuda.FloatTensor``) that the distributed optimizer and clip_grads test for;
  ``torch.distributed.all_to_all_single`` takes split sizes
  given as tensors (the alltoall MoE dispatcher moves its split sizes to the host as numpy
  arrays, but leaves tensors that are already there as tensors, which c10d refuses).

Without apex, Megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which
refuses sequence parallelism; ``build_model`` makes it build the same torch norm with the
``sequence_parallel`` attribute on its parameters, as apex's FusedLayerNorm does on GPUs (so that
finalize_model_grads sums their gradients over the tensor-parallel ranks). Both runs use it.

The CUDA random-number tracker is Megatron-core's own no-op one
(``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``) in the Megatron-core
run, where the CUDA generator does not exist; every configuration here has dropout 0.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import pkgutil
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

MCORE_MODULES = (
    "parallel_state",
    "tensor_parallel",
    "pipeline_parallel",
    "distributed",
    "optimizer",
    "dist_checkpointing",
    "optimizer_param_scheduler",  # a module: the learning-rate scheduler Megatron-LM's loop builds
)
_ON_MEGATRON_EXT = False


# Megatron-core's own modules that ran beside megatron_ext's: submodules of the packages above
# that megatron_ext does not have (features it does not implement), in import order.
MEGATRON_CORE_FALLBACKS: list[str] = []


class _MegatronCoreFallback(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.<package>.<name>`` that megatron_ext lacks in Megatron-core's files;
    what those import from megatron.core's aliased packages resolves to megatron_ext."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 4 or parts[:2] != ["megatron", "core"] or parts[2] not in MCORE_MODULES:
            return None
        location = os.path.join(self.root, *parts[2:])
        if os.path.isdir(location):
            MEGATRON_CORE_FALLBACKS.append(fullname)
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(location, "__init__.py"), submodule_search_locations=[location]
            )
        if os.path.isfile(location + ".py"):
            MEGATRON_CORE_FALLBACKS.append(fullname)
            return importlib.util.spec_from_file_location(fullname, location + ".py")
        return None


def use_megatron_ext() -> None:
    """Resolves ``megatron.core.{parallel_state, tensor_parallel, pipeline_parallel, distributed,
    optimizer, dist_checkpointing, optimizer_param_scheduler}`` and the packages' submodules (at any
    depth) to megatron_ext's modules;
    a submodule megatron_ext does not have is Megatron-core's own (listed in
    MEGATRON_CORE_FALLBACKS). Call before anything imports ``megatron.core``."""
    global _ON_MEGATRON_EXT
    if "megatron.core" in sys.modules:
        raise RuntimeError("use_megatron_ext() must run before megatron.core is imported")
    aliases = {}
    for name in MCORE_MODULES:
        module = importlib.import_module(f"megatron_ext.{name}")
        aliases[f"megatron.core.{name}"] = module
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), f"megatron_ext.{name}."):
            alias = "megatron.core." + info.name.removeprefix("megatron_ext.")
            aliases[alias] = importlib.import_module(info.name)
    root = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    sys.modules.update(aliases)
    sys.meta_path.insert(0, _MegatronCoreFallback(root))
    _ON_MEGATRON_EXT = True
    import megatron.core

    for name in MCORE_MODULES:
        setattr(megatron.core, name, aliases[f"megatron.core.{name}"])


class _CpuStream:
    """A CUDA stream's stand-in on the CPU: one stream, whose waits and syncs do nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _CpuStream:
        return _CPU_STREAM

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuStream:  # the event: it synchronizes
        return self

    def synchronize(self) -> None:
        pass


_CPU_STREAM = object.__new__(_CpuStream)


def cpu_patches(full: bool) -> None:
    """Points Megatron-core's CUDA device calls at the CPU (see the module docstring)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    tensor = torch.tensor
    torch.tensor = lambda *args, pin_memory=False, **kwargs: tensor(*args, **kwargs)
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *args, **kwargs: _CPU_STREAM
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    if not full:
        return
    torch.cuda.synchronize = lambda *args, **kwargs: None

    def on_cpu(factory):
        def make(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name

    torch.Tensor.type = cuda_type_name
    all_to_all_single = torch.distributed.all_to_all_single

    def split_sizes_as_lists(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = lambda sizes: sizes.tolist() if torch.is_tensor(sizes) else sizes  # noqa: E731
        return all_to_all_single(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs
        )

    torch.distributed.all_to_all_single = split_sizes_as_lists


def bind_te_general_gemm() -> None:
    """Without TransformerEngine, Megatron-core's MoE router reads ``moe_utils.te_general_gemm``,
    a name that is then never bound: None, as TransformerEngine's absence means there."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.__dict__.setdefault("te_general_gemm", None)


@dataclass
class Run:
    """One training run: the model's shape and the parallel layout."""

    arch: str = "gpt"  # or "llama", or "mla" (llama's with multi-latent attention, YaRN)
    tp: int = 1
    pp: int = 1
    vp: int | None = None
    cp: int = 1  # > 1: Megatron-core's local spec with megatron_ext's context-parallel core_attention
    cp_comm_type: str = "p2p"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype: torch.dtype = torch.float64
    layers: int = 4
    hidden: int = 32
    heads: int = 4
    query_groups: int = 2  # llama
    ffn: int | None = None  # None: 4 x hidden (gpt), 2 x hidden (llama)
    seq: int = 16
    vocab: int = 64
    micro_batch: int = 2
    global_batch: int = 8
    steps: int = 3
    lr: float = 1e-2
    optimizer: str = "adam"  # or "sgd" (momentum 0.9)
    seed: int = 1234
    fused: bool = False  # megatron_ext's fused CPU kernels (megatron_ext's model only)
    num_experts: int | None = None  # an MoE layer (Megatron-core's, SequentialMLP) in every layer
    topk: int = 2
    ep: int = 1
    dispatcher: str = "allgather"  # or "alltoall"
    aux_loss_coeff: float = 0.0  # the router's balance loss (Megatron-core's default: none)
    z_loss_coeff: float | None = None  # the router's z-loss
    packed: bool = False  # packed rows (thd): Megatron-core's local spec with megatron_ext's core_attention
    # A data_parallel_sharding_strategy: FullyShardedDataParallel (use_megatron_fsdp) instead of
    # DistributedDataParallel; megatron_ext underneath only (Megatron-core's needs CUDA)
    fsdp: str | None = None


def config_fields(run: Run) -> dict[str, Any]:
    """The TransformerConfig fields of ``run``, for either library's class."""
    fields: dict[str, Any] = dict(
        num_layers=run.layers, hidden_size=run.hidden, num_attention_heads=run.heads,
        tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
        virtual_pipeline_model_parallel_size=run.vp, sequence_parallel=run.sequence_parallel,
        params_dtype=run.dtype, pipeline_dtype=run.dtype, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=run.fused,
        bias_dropout_fusion=run.fused, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=run.fused and run.arch == "llama",
        persist_layer_norm=run.fused and run.arch == "llama",
    )
    if run.cp > 1:
        fields.update(context_parallel_size=run.cp, cp_comm_type=run.cp_comm_type)
    if run.num_experts is not None:
        fields.update(
            num_moe_experts=run.num_experts, moe_router_topk=run.topk,
            expert_model_parallel_size=run.ep, moe_token_dispatcher_type=run.dispatcher,
            moe_grouped_gemm=False, moe_aux_loss_coeff=run.aux_loss_coeff, moe_z_loss_coeff=run.z_loss_coeff,
        )
    if run.arch in ("llama", "mla"):
        fields.update(
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            ffn_hidden_size=run.ffn or 2 * run.hidden,
        )
    if run.arch == "llama":
        fields.update(num_query_groups=run.query_groups)
    elif run.arch == "mla":
        head = run.hidden // run.heads
        fields.update(
            q_lora_rank=run.hidden // 2, kv_lora_rank=run.hidden // 4, qk_head_dim=head,
            qk_pos_emb_head_dim=head // 2, v_head_dim=head + 2, qk_layernorm=True, rope_type="yarn",
            rotary_scaling_factor=4.0, original_max_position_embeddings=run.seq // 2, mscale=1.0,
            mscale_all_dim=1.0,
        )
    elif run.arch == "gpt":
        fields.update(ffn_hidden_size=run.ffn or 4 * run.hidden)
    elif run.arch != "llama":
        raise ValueError(f"arch must be 'gpt', 'llama' or 'mla', got {run.arch!r}")
    return fields


def transformer_config(run: Run, stack: str = "megatron.core") -> Any:
    module = importlib.import_module(f"{stack}.transformer.transformer_config")
    cls = module.MLATransformerConfig if run.arch == "mla" else module.TransformerConfig
    return cls(**config_fields(run))


def mla_without_te() -> None:
    """Without TransformerEngine, Megatron-core's ``extensions.transformer_engine`` still imports
    (its classes built over a ``MagicMock``), so its multi-latent attention believes TE is there and
    calls ``isinstance`` with a mock, a TypeError: told here that TE is absent, as it is."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def _use_torch_norm_with_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def torch_norm(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        norm_class = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_class(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = torch_norm


def build_model(run: Run, config: Any, stack: str = "megatron.core") -> list[torch.nn.Module]:
    """Megatron-LM's model provider: one GPTModel per virtual stage of this rank; Megatron-core's
    with its local spec, or megatron_ext's."""
    ps = importlib.import_module(f"{stack}.parallel_state")
    kwargs = dict(
        share_embeddings_and_output_weights=run.arch == "gpt",
        position_embedding_type="rope" if run.arch in ("llama", "mla") else "learned_absolute",
    )
    if stack == "megatron.core":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        _use_torch_norm_with_sequence_parallel()
        if run.num_experts is not None:
            bind_te_general_gemm()
        spec = get_gpt_layer_local_spec(
            num_experts=run.num_experts, moe_grouped_gemm=False,
            normalization="RMSNorm" if run.arch in ("llama", "mla") else None,
            multi_latent_attention=run.arch == "mla", qk_layernorm=run.arch == "mla",
        )
        # Megatron-core's own DotProductAttention refuses context parallelism and packed rows
        # (packed_seq_params), and takes no k_channels / v_channels, which its multi-latent attention
        # passes (its issue 1589).
        if run.arch == "mla":
            mla_without_te()
        if run.cp > 1 or run.arch == "mla" or run.packed:
            from megatron_ext.transformer.context_parallel import ContextParallelDotProductAttention

            spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
        build = lambda **kw: GPTModel(config, spec, run.vocab, run.seq, **kw)  # noqa: E731
    else:
        from megatron_ext.models import GPTModel

        build = lambda **kw: GPTModel(config, run.vocab, run.seq, **kw)  # noqa: E731
    chunks = []
    for stage in range(run.vp or 1):
        vp_stage = stage if run.vp else None
        chunks.append(build(
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, **kwargs,
        ))
    return chunks


# Megatron-core's parameter names -> megatron_ext's (Megatron's earlier names; multi-latent
# attention keeps Megatron-core's but for its latent norms).
_EXT_NAMES = {
    ".linear_qkv.": ".query_key_value.", ".linear_proj.": ".dense.",
    ".pre_mlp_layernorm.": ".post_attention_layernorm.", ".linear_fc1.": ".dense_h_to_4h.",
    ".linear_fc2.": ".dense_4h_to_h.",
}
_MLA_NAMES = {".q_layernorm.": ".q_latent_norm.", ".kv_layernorm.": ".kv_latent_norm."}


def megatron_ext_name(name: str, mla: bool = False) -> str:
    """The name of a Megatron-core GPTModel's parameter in megatron_ext's GPTModel."""
    renames = {**_EXT_NAMES, **_MLA_NAMES, ".linear_proj.": ".linear_proj."} if mla else _EXT_NAMES
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copies a Megatron-core GPTModel's parameters into a megatron_ext GPTModel of the same shape
    and layout (this rank's shards; the QKV and gated fc1 layouts are the same)."""
    target_params = dict(target.named_parameters())
    mla = bool(getattr(target.config, "multi_latent_attention", False))
    names = []
    for name, param in source.named_parameters():
        name = megatron_ext_name(name, mla)
        names.append(name)
        with torch.no_grad():
            target_params[name].copy_(param)
    if sorted(names) != sorted(target_params):
        raise ValueError(f"parameters differ: {sorted(set(names) ^ set(target_params))}")


def batches(run: Run, step: int, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, ...]]:
    """This data-parallel rank's micro-batches of global step ``step``: (tokens, labels,
    loss mask, position ids, causal mask), the same on every rank of a replica. Every step sees
    the same global batch, so the loss falls from step to step."""
    g = torch.Generator().manual_seed(run.seed)
    data = torch.randint(0, run.vocab, (run.global_batch, run.seq + 1), generator=g)
    per_rank = run.global_batch // dp_size
    mine = data[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    positions = torch.arange(run.seq).expand(run.micro_batch, run.seq)
    causal = torch.triu(torch.ones(run.seq, run.seq, dtype=torch.bool), 1).view(1, 1, run.seq, run.seq)
    out = []
    for i in range(0, per_rank, run.micro_batch):
        chunk = mine[i:i + run.micro_batch]
        mask = torch.ones(run.micro_batch, run.seq, dtype=run.dtype)
        out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous(), mask, positions, causal))
    return out


def forward_step(data_iterator, model):
    """Megatron-LM's forward step: the model's per-token losses, masked and averaged. Megatron-core's
    attention gets the causal mask as a tensor (Megatron-LM's data loader makes one); megatron_ext's
    model applies it as a flag. With context parallelism the loss is Megatron-LM's three values (the
    sum over this rank's tokens and their count: the schedule divides, and the data-parallel
    average over dp x cp makes it the mean over the sequence); the reported loss is this rank's
    mean."""
    tokens, labels, loss_mask, positions, causal = next(data_iterator)
    module = getattr(model, "module", model)
    takes_mask = type(module).__module__.startswith("megatron.core")
    split_sequence = getattr(module.config, "context_parallel_size", 1) > 1
    losses = model(tokens, positions, causal if takes_mask else None, labels=labels)

    def loss_func(output):
        total = (output.to(loss_mask.dtype) * loss_mask).sum()
        loss = total / loss_mask.sum()
        if split_sequence:
            return total, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}
        return loss, {"lm loss": loss.clone().detach()}  # the schedule scales loss in place

    return losses, loss_func


def setup(run: Run, stack: str = "megatron.core", weights_from: list[torch.nn.Module] | None = None
          ) -> tuple[list[torch.nn.Module], Any, Any]:
    """Parallel state (when not yet initialised), model chunks wrapped in DDP, the optimizer and
    its scheduler; the config's hooks set as Megatron-LM's training loop sets them. ``stack`` is
    "megatron.core" or "megatron_ext"; ``weights_from``: Megatron-core model chunks (DDP-wrapped)
    whose weights megatron_ext's model starts from."""
    ps = importlib.import_module(f"{stack}.parallel_state")
    tensor_parallel = importlib.import_module(f"{stack}.tensor_parallel")
    distributed = importlib.import_module(f"{stack}.distributed")
    optim = importlib.import_module(f"{stack}.optimizer")

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
            virtual_pipeline_model_parallel_size=run.vp, context_parallel_size=run.cp,
            expert_model_parallel_size=run.ep,
        )
    on_megatron_core = stack == "megatron.core" and not _ON_MEGATRON_EXT
    tensor_parallel.model_parallel_cuda_manual_seed(
        run.seed, **({"inference_rng_tracker": True} if on_megatron_core else {}), force_reset_rng=True
    )
    torch.manual_seed(run.seed)
    # Megatron-core's local spec builds its norms (torch.nn.LayerNorm / RMSNorm) in the default
    # dtype; Megatron-LM casts 16-bit models after building, and a float64 model needs this.
    torch.set_default_dtype(run.dtype)
    config = transformer_config(run, stack)
    model = build_model(run, config, stack)
    if weights_from is not None:
        for source, target in zip(weights_from, model):
            copy_weights(getattr(source, "module", source), target)
    fsdp = {} if run.fsdp is None else dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=run.fsdp)
    ddp_config = distributed.DistributedDataParallelConfig(
        use_distributed_optimizer=run.distributed_optimizer, overlap_grad_reduce=False, **fsdp,
    )
    wrapper = distributed.FullyShardedDataParallel if fsdp else distributed.DistributedDataParallel
    model = [wrapper(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(model)]
    optimizer = optim.get_megatron_optimizer(
        optim.OptimizerConfig(
            # Megatron-core clips float32 gradients only (clip_grads asserts their type).
            optimizer=run.optimizer, lr=run.lr, weight_decay=0.01, sgd_momentum=0.9,
            clip_grad=1.0 if run.dtype == torch.float32 else 0.0,
            use_distributed_optimizer=run.distributed_optimizer,
            bf16=False, fp16=False, params_dtype=run.dtype,
        ),
        model,
    )
    # Megatron-LM's loop sets each group's learning rate and weight decay (times its lr_mult /
    # wd_mult) through Megatron-core's scheduler; here both are constant. megatron_ext's optimizer
    # starts its groups there itself, so its own model needs none.
    scheduler = None
    if stack == "megatron.core":
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=run.lr, max_lr=run.lr, min_lr=run.lr, lr_warmup_steps=0,
            lr_decay_steps=run.steps, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
            wd_incr_steps=run.steps, wd_incr_style="constant",
        )
    config.finalize_model_grads_func = distributed.finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer, scheduler


def train_step(run: Run, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, step: int,
               stack: str = "megatron.core") -> tuple[float | None, float]:
    """One global step; returns the step's loss (mean over micro-batches and data-parallel
    replicas) on the last pipeline stage, None elsewhere, and the gradient norm ``optimizer.step()``
    returned (every rank)."""
    ps = importlib.import_module(f"{stack}.parallel_state")
    get_forward_backward_func = importlib.import_module(
        f"{stack}.pipeline_parallel"
    ).get_forward_backward_func

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    micro = batches(run, step, dp_rank, dp_size)
    if run.cp > 1:  # this cp rank's chunks of each sequence (the mask's rows: dim 2)
        cp_slice = importlib.import_module(f"{stack}.utils").get_batch_on_this_cp_rank
        names = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
        micro = [tuple(cp_slice(dict(zip(names, mb))).values()) for mb in micro]
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(micro) for _ in model]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(micro), seq_length=run.seq, micro_batch_size=run.micro_batch,
        forward_only=False,
    )
    _, grad_norm, _ = optimizer.step()
    if scheduler is not None:
        scheduler.step(increment=1)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None, float(grad_norm)
    # Each cp rank's loss is the mean over its tokens, as many on every rank.
    loss = torch.stack([m["lm loss"] for m in losses]).mean().to(torch.float64)
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(loss) / (dp_size * run.cp), float(grad_norm)


def train(run: Run) -> dict[str, Any]:
    """Trains ``run.steps`` steps. Returns ``losses``, the per-step losses on the last pipeline
    stage (None elsewhere), ``grad_norms``, the norms ``optimizer.step()`` returned, and ``params``,
    this rank's parameters after training as plain lists by name (``chunk{i}.`` before each model
    chunk's names)."""
    from megatron.core import parallel_state as ps

    model, optimizer, scheduler = setup(run)
    try:
        steps = [train_step(run, model, optimizer, scheduler, step) for step in range(run.steps)]
    finally:
        ps.destroy_model_parallel()
    params = {
        f"chunk{i}.{name}": p.detach().double().flatten().tolist()
        for i, chunk in enumerate(model)
        for name, p in chunk.module.named_parameters()
    }
    losses, grad_norms = [loss for loss, _ in steps], [norm for _, norm in steps]
    return {"losses": None if losses[0] is None else losses, "grad_norms": grad_norms, "params": params}
