"""The training loop: set-up, steps, evaluation, checkpoints and the run's end."""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.comm_errors import reported
from megatron_ext.dist_checkpointing import CheckpointingException
from megatron_ext.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
)
from megatron_ext.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_ext.training import gpt_data
from megatron_ext.pipeline_parallel import get_forward_backward_func
from megatron_ext.training.checkpointing import (
    find_checkpoint,
    gathered_params,
    load_checkpoint,
    save_checkpoint,
)
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron_ext.transformer.transformer_layer import is_moe_layer
from megatron_ext.transformer.moe.router_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics
from megatron_ext.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging
from megatron_ext.training.arguments import parse_args
from megatron_ext.training.progress import RunLog
from megatron_ext.training.report import step_report
from megatron_ext.training.gpt import forward_step, load_corpus, step_microbatches
from megatron_ext.training.initialize import device_of, init_process_group
from megatron_ext.training.model import build_model, params_dtype
from megatron_ext.training.outputs import export_hf, log_event, run_config, summary, write_outputs
from megatron_ext.training.validation import (
    check_args,
    resolve_timeout,
    tokenizer_dir,
    tokenizer_of,
    uses_gpu,
)


def train(args: argparse.Namespace, model_provider=None, forward_step_func=None) -> dict:
    """Runs the training loop in an initialised process group; returns the log (every rank).

    ``model_provider(args, device)`` returns the rank's model chunks (default: ``build_model``, the
    GPT the flags describe); ``forward_step_func(data_iterator, model)`` returns the output and its
    loss function, as the schedules take it (default: the GPT program's ``forward_step``)."""
    world_size = dist.get_world_size()
    check_args(args, world_size)
    corpus = None
    if args.data_path is None and args.sft is None and not args.mock_data:  # datasets: once the groups exist
        corpus = load_corpus(args.data, args.seq_len + 2, tokenizer_dir(args))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        distributed_timeout_minutes=args.timeout / 60,
        # ZB-V's V: the first and the last stage (both copies of the tied embedding) on rank 0.
        get_embedding_ranks=(lambda ranks: [ranks[0]]) if args.schedule == "zb-v" else None,
    )
    if args.schedule == "zb-v":
        parallel_state.set_pipeline_model_parallel_layout("v")
    try:
        if args.data_path is not None or args.mock_data:
            sizes = gpt_data.split_sizes(args.steps, args.global_batch_size, args.eval_interval,
                                         args.eval_iters)
            tokenizer = tokenizer_of(args)
            corpus = gpt_data.build_datasets(args.data_path, args.split, tokenizer, args.seq_len, args.seed,
                                             sizes, args.data_cache_path)
        elif args.sft is not None:
            sizes = gpt_data.split_sizes(args.steps, args.global_batch_size, args.eval_interval,
                                         args.eval_iters)
            tokenizer = gpt_data.HuggingFaceTokenizer(tokenizer_dir(args))
            corpus = gpt_data.build_sft_datasets(args.sft, args.split, tokenizer, args.seq_len, args.seed,
                                                 sizes, args.pad_seq_to_mult)
            if dist.get_rank() == 0:
                for line in gpt_data.sft_truncation_warnings(corpus, args.sft, args.seq_len):
                    print(f"warning: --sft {line}", file=sys.stderr, flush=True)
        return _train_loop(args, corpus, model_provider or build_model, forward_step_func or forward_step)
    finally:
        parallel_state.destroy_model_parallel()


def microbatches_of(data, first_sample: int, args: argparse.Namespace, device: torch.device,
                    what: str) -> list:
    """This data-parallel rank's micro-batches of the global batch at ``first_sample`` of a tokenized
    split, every rank refusing token ids beyond the model's vocabulary."""
    microbatches = gpt_data.global_batch_microbatches(
        data, first_sample, args.global_batch_size, args.micro_batch_size,
        parallel_state.get_data_parallel_rank(), args.dp, device,
        **({"keys": gpt_data.SFT_KEYS} if args.sft is not None else {}))
    gpt_data.check_token_ids(microbatches, args.tokens, what, device, args.vocab_size)
    return microbatches


def evaluate(args: argparse.Namespace, evaluation: int, valid, model, chunks: list, forward_backward,
             forward_step_func, num_microbatches: int, needs_data: list[bool],
             device: torch.device) -> tuple[float, float]:
    """The mean loss of --eval-iters global batches of the validation split, evaluation
    ``evaluation`` reading the ones after those of the evaluations before it (with --sft the mean
    over all their response tokens, as Megatron-LM's evaluation sums the [sum, count] pairs), and
    the number of tokens (--sft) or global batches it is the mean of."""
    for chunk in chunks:
        chunk.eval()
    total, weight = 0.0, 0.0
    with torch.no_grad():
        for iteration in range(args.eval_iters):
            first = (evaluation * args.eval_iters + iteration) * args.global_batch_size
            microbatches = microbatches_of(valid, first, args, device, "the validation split")
            iterators = [iter(microbatches) if needed else None for needed in needs_data]
            step_losses = forward_backward(
                forward_step_func=forward_step_func,
                data_iterator=iterators[0] if len(chunks) == 1 else iterators,
                model=model, num_microbatches=num_microbatches, seq_length=args.seq_len,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            batch_total, batch_weight = global_loss_totals(step_losses, device)
            if args.sft is None:  # the mean of the global batches' means
                batch_total, batch_weight = batch_total / batch_weight, 1.0
            total, weight = total + batch_total, weight + batch_weight
    for chunk in chunks:
        chunk.train()
    if args.sft is not None and weight == 0:
        first = evaluation * args.eval_iters * args.global_batch_size
        raise ValueError(
            f"the validation rows [{first}, {first + args.eval_iters * args.global_batch_size}) hold no "
            f"response token to evaluate: their records' prompts fill the --seq-len {args.seq_len} rows"
        )
    return (total / weight if weight > 0 else 0.0), weight


def _train_loop(args: argparse.Namespace, corpus: torch.Tensor | list, model_provider,
                forward_step_func) -> dict:
    device = device_of(args)
    # Gradients accumulate in float32 main_grad buffers (16-bit runs) and are averaged over the
    # data-parallel group (reduce-scattered for the distributed optimizer) in buckets that start
    # during the last micro-batch's backward; the earlier micro-batches only accumulate (no_sync).
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
    )
    if args.use_megatron_fsdp:
        chunks = [FullyShardedDataParallel(chunk.config, ddp_config, chunk, device=device)
                  for chunk in model_provider(args, device)]
    else:
        chunks = [
            DistributedDataParallel(
                chunk,
                data_parallel_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
                bucket_size_bytes=args.grad_bucket_bytes,
                ddp_config=ddp_config,
            )
            for chunk in model_provider(args, device)
        ]
    # One chunk: a plain model, as before; several: the list the interleaved schedule takes.
    model = chunks[0] if len(chunks) == 1 else chunks
    config = chunks[0].module.config
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            bf16=args.bf16,
            fp16=args.fp16,
            params_dtype=params_dtype(args),
            clip_grad=args.clip_grad,
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_param_gather=args.overlap_param_gather,
        ),
        chunks,
    )
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(args, optimizer)
    start_step = resume(args, model, optimizer, scheduler)
    log_event(args, event="start", attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
              resumed_from=start_step, config=run_config(args))
    report = step_report(chunks, optimizer, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp,
                         dp=args.dp, vpp=args.virtual_pipeline, global_batch_size=args.global_batch_size,
                         seq_length=args.seq_len)
    if dist.get_rank() == 0:
        print(report, flush=True)
    if args.virtual_pipeline is not None and args.schedule == "1f1b":
        forward_backward = get_forward_backward_func()  # interleaved 1F1B
    else:
        forward_backward = get_forward_backward_func(schedule=args.schedule)
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.dp)
    # Only the chunk that embeds and the one that computes the loss read the batch; with packed
    # rows every chunk reads it, for the sequence boundaries its attention needs.
    needs_data = [args.sft is not None or c.module.pre_process or c.module.post_process for c in chunks]
    run_log = RunLog(args, start_step, run_config(args), device)
    losses, tokens_per_s, grad_norms, skipped, aux_losses, mtp, val_losses = [], [], [], 0, [], [], []
    loss_tokens = []  # --sft: the response tokens of each step's global batch
    datasets = corpus if args.data_path is not None or args.sft is not None or args.mock_data else None
    get_moe_layer_wise_logging_tracker().clear()  # nothing tracked by an earlier run in this process
    MTPLossLoggingHelper.tracker.clear()
    tokens_per_step = args.global_batch_size * args.seq_len
    for chunk in chunks:
        chunk.train()
    for step in range(start_step, args.steps):
        start = time.perf_counter()
        # step k reads the samples [k x G, (k + 1) x G): the data position is the step
        if datasets is not None:
            microbatches = microbatches_of(datasets[0], step * args.global_batch_size, args, device,
                                           "the train split")
        else:
            microbatches = step_microbatches(corpus, step, args, device)
        optimizer.zero_grad(set_to_none=True)
        iterators = [iter(microbatches) if needed else None for needed in needs_data]
        step_losses = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=iterators[0] if len(chunks) == 1 else iterators,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=args.seq_len,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        nonfinite = (
            nonfinite_report(step_losses, chunks, args, device) if args.check_for_nan_in_loss_and_grad else ""
        )
        total, weight = global_loss_totals(step_losses, device)
        if args.sft is not None and weight == 0:  # before the update, which would move on no data
            first = step * args.global_batch_size
            raise ValueError(
                f"step {step + 1}: the train rows [{first}, {first + args.global_batch_size}) hold no "
                f"response token to train on: their records' prompts fill the --seq-len {args.seq_len} rows; "
                "give a longer --seq-len or shorter prompts"
            )
        if nonfinite and not args.skip_nonfinite:
            raise FloatingPointError(
                f"step {step + 1}: {nonfinite}; stopped before the update, so no checkpoint holds it "
                f"(--skip-nonfinite skips such steps)"
            )
        # the rate this step uses
        groups = optimizer.param_groups
        learning_rate = get_canonical_lr_for_logging(groups) or groups[0]["lr"]
        loss_scale = optimizer.get_loss_scale().item() if args.fp16 else None
        if nonfinite:
            update_successful, grad_norm = False, None
            run_log.notice(f"step {step + 1}: {nonfinite}; the step is skipped")
        else:
            update_successful, grad_norm, _ = optimizer.step()
        if update_successful:  # as Megatron-LM: a skipped step does not move the schedule
            scheduler.step(increment=args.global_batch_size)
        skipped += not update_successful
        grad_norms.append(grad_norm)
        losses.append(total / weight if weight > 0 else 0.0)
        if args.sft is not None:
            loss_tokens.append(int(weight))
        aux_losses.append(moe_aux_losses(args, num_microbatches, config))
        mtp.append(mtp_losses(args, num_microbatches, device))
        tokens_per_s.append(tokens_per_step / (time.perf_counter() - start))
        # the norm before clipping; none for a skipped step
        run_log.step(step + 1, loss=losses[-1], learning_rate=learning_rate, grad_norm=grad_norm,
                     skipped=not update_successful, tokens_per_s=tokens_per_s[-1], loss_scale=loss_scale,
                     extra={"loss_tokens": loss_tokens[-1]} if args.sft is not None else {},
                     losses={**aux_losses[-1], **mtp[-1]})
        if args.eval_interval is not None and (step + 1) % args.eval_interval == 0:
            val, val_weight = evaluate(args, (step + 1) // args.eval_interval - 1, datasets[1], model, chunks,
                                       forward_backward, forward_step_func, num_microbatches, needs_data,
                                       device)
            val_losses.append((step + 1, val))
            run_log.evaluation(step + 1, val,
                               {"loss_tokens": int(val_weight)} if args.sft is not None else {})
        at_interval = args.save_interval is not None and (step + 1) % args.save_interval == 0
        if args.save and (at_interval or step + 1 == args.steps):
            log_event(args, event="save", iteration=step + 1,
                      path=save(args, step + 1, model, optimizer, scheduler))
    run_log.close()
    if args.export_hf is not None:
        with gathered_params(chunks):
            path = export_hf(args, [c.module for c in chunks])
        log_event(args, event="export_hf", path=path)
    log_event(args, event="end", steps=len(losses), skipped_steps=skipped)
    return {
        "config": run_config(args),
        "start_step": start_step,
        "losses": losses,
        "tokens_per_s": tokens_per_s,
        "grad_norms": grad_norms,
        "aux_losses": aux_losses,
        "mtp_losses": mtp,
        "val_losses": val_losses,
        "loss_tokens": loss_tokens,
        "skipped_steps": skipped,
    }


def global_loss_totals(losses: list[dict[str, torch.Tensor]],
                       device: torch.device | str = "cpu") -> tuple[float, float]:
    """The step's loss as (total, weight), known on every rank: with per-micro-batch means, their
    sum over the micro-batches and data-parallel ranks and the number of (micro-batch, rank) pairs
    (the mean of the means over the micro-batches, then over the data-parallel ranks); with
    [sum, count] pairs, the loss summed over every token of the global batch and their count."""
    value = torch.zeros(2, dtype=torch.float64, device=device)
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    # The losses are where the last virtual stage is: the last rank, or rank 0 in ZB-V's V.
    if parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=None if vp is None else vp - 1):
        reported_values = torch.stack([d["lm loss"].double().reshape(-1) for d in losses])
        per_token = reported_values.size(1) == 2
        if per_token:  # each cp rank holds its part of the sums
            value += reported_values.sum(0)
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        else:  # the cp ranks report the same means
            value += torch.stack([reported_values.mean(), torch.ones((), dtype=torch.float64)])
            group = parallel_state.get_data_parallel_group()
        with reported("all-reduce of the step's loss", group):
            dist.all_reduce(value, group=group)
    v_layout = parallel_state.get_pipeline_model_parallel_layout() == "v"
    src = (parallel_state.get_pipeline_model_parallel_first_rank() if v_layout
           else parallel_state.get_pipeline_model_parallel_last_rank())
    with reported("broadcast of the step's loss", parallel_state.get_pipeline_model_parallel_group()):
        dist.broadcast(value, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    total, weight = value.tolist()
    return total, weight


def nonfinite_report(losses: list[dict[str, torch.Tensor]], chunks: list[DistributedDataParallel],
                     args: argparse.Namespace, device: torch.device) -> str:
    """Which ranks saw a NaN or Inf in their loss or (fp16 aside, where the loss scaler skips
    such steps) their gradients, known on every rank; '' when none did."""
    loss_bad = any(not bool(torch.isfinite(d["lm loss"]).all()) for d in losses)
    grad_bad = not args.fp16 and any(
        not bool(torch.isfinite(g).all())
        for chunk in chunks
        for p in chunk.module.parameters()
        if (g := getattr(p, "main_grad", p.grad)) is not None
    )
    flags = torch.zeros(dist.get_world_size(), 2, device=device)
    flags[dist.get_rank()] = torch.tensor([float(loss_bad), float(grad_bad)])
    with reported("all-reduce of the non-finite loss and gradient flags", None):
        dist.all_reduce(flags)
    found = [
        f"non-finite {what} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        for what, column in (("loss", 0), ("gradients", 1))
        if (ranks := flags[:, column].nonzero().flatten().tolist())
    ]
    return " and ".join(found)


def mtp_losses(args: argparse.Namespace, num_microbatches: int, device: torch.device | str = "cpu") -> dict:
    """The step's multi-token prediction losses (each depth's mean over the micro-batches and the data),
    known on every rank; clears the tracker."""
    if args.mtp_num_layers is None:
        return {}
    totals: dict[str, torch.Tensor] = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, 0, total_loss_dict=totals)
    names = [f"mtp_{k + 1} loss" for k in range(args.mtp_num_layers)]
    values = torch.zeros(len(names), dtype=torch.float64, device=device)
    if totals:
        values += torch.stack([totals[name].to(device, torch.float64) for name in names])
    v_layout = parallel_state.get_pipeline_model_parallel_layout() == "v"
    src = (parallel_state.get_pipeline_model_parallel_first_rank() if v_layout
           else parallel_state.get_pipeline_model_parallel_last_rank())
    with reported("broadcast of the step's multi-token prediction losses",
                  parallel_state.get_pipeline_model_parallel_group()):
        dist.broadcast(values, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    return dict(zip(names, values.tolist()))


def moe_aux_losses(
    args: argparse.Namespace, num_microbatches: int, config: TransformerConfig
) -> dict[str, float]:
    """The step's auxiliary losses (mean over micro-batches and the model's MoE layers), reduced over
    the ranks as Megatron-LM logs them (every tracked name on every rank: a pipeline stage without
    MoE layers takes part with zeros); clears the tracker."""
    if args.num_experts is None:
        return {}
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    kinds, coeffs = (kinds, coeffs) if isinstance(kinds, list) else ([kinds], [coeffs])
    balance = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
    names = [balance[kind] for kind, coeff in zip(kinds, coeffs) if kind in balance and coeff > 0]
    names += ["z_loss"] if config.moe_z_loss_coeff else []
    depths = config.mtp_num_layers or 0
    pattern = [int(is_moe_layer(config, n)) for n in range(1, config.num_layers + 1)]
    totals: dict[str, torch.Tensor] = {}
    track_moe_metrics(1.0 / num_microbatches, 0, total_loss_dict=totals, force_initialize=True,
                      track_names=names, num_layers=config.num_layers + depths, moe_layer_freq=pattern,
                      mtp_num_layers=depths or None)
    return {name: float(value) for name, value in totals.items()}


def build_scheduler(args: argparse.Namespace, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Megatron-LM's learning-rate and weight-decay schedule of the flags, counted in samples (a step
    is --global-batch-size of them), the warm-up's fraction of the decay's samples where given."""
    samples = args.global_batch_size
    decay = (args.lr_decay_iters or args.steps) * samples
    warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
              else args.lr_warmup_iters * samples)
    start_wd = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end_wd = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=args.steps * samples, wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * samples,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


def save(
    args: argparse.Namespace, iteration: int, model: torch.nn.Module, optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
) -> str:
    # The data position is the step: step k always reads the same global batch.
    data = {"consumed_samples": iteration * args.global_batch_size,
            "global_batch_size": args.global_batch_size}
    if args.sft is not None:  # what, besides the records, decides the rows
        data["pad_seq_to_mult"] = args.pad_seq_to_mult
    metadata = {"data": data, "seed": args.seed, "opt_param_scheduler": scheduler.state_dict()}
    return save_checkpoint(args.save, iteration, model, optimizer, metadata=metadata,
                           overwrite=args.allow_overwrite, keep_last=args.keep_last)


def resume(args: argparse.Namespace, model: torch.nn.Module, optimizer: MegatronOptimizer,
           scheduler: OptimizerParamScheduler) -> int:
    """Loads --load if given; returns the step to continue from. The schedule continues from the
    checkpoint's position (its samples; before the schedule was saved: the step's), under this run's
    schedule flags."""
    if args.load is None:
        return 0
    if find_checkpoint(args.load) is None:  # allowed by check_checkpoint_paths
        if dist.get_rank() == 0:
            print(f"no checkpoint in {args.load!r} yet; training from scratch", flush=True)
        return 0
    marker = load_checkpoint(
        args.load, model, None if args.no_load_optim else optimizer, load_rng=not args.no_load_rng
    )
    if args.no_load_optim:  # 16-bit weights: the main copies from the loaded ones, as Megatron-LM
        with gathered_params(model):
            optimizer.reload_model_params()
    data = marker["metadata"].get("data", {})
    if data.get("global_batch_size", args.global_batch_size) != args.global_batch_size:
        raise ValueError(
            f"the checkpoint was trained with --global-batch-size {data['global_batch_size']}, "
            f"this run has {args.global_batch_size}"
        )
    if args.sft is not None and data.get("pad_seq_to_mult", args.pad_seq_to_mult) != args.pad_seq_to_mult:
        raise ValueError(
            f"the checkpoint was trained on --sft rows padded with --pad-seq-to-mult "
            f"{data['pad_seq_to_mult']}, this run has {args.pad_seq_to_mult}: other rows; give "
            f"--pad-seq-to-mult {data['pad_seq_to_mult']}"
        )
    position = marker["metadata"].get("opt_param_scheduler", {}).get("num_steps")
    scheduler.step(increment=marker["iteration"] * args.global_batch_size if position is None else position)
    if dist.get_rank() == 0:
        print(f"resumed from iteration {marker['iteration']} ({marker['path']})", flush=True)
        if not marker["rng_loaded"] and not args.no_load_rng:
            print(f"note: {marker['path']} was saved at layout {marker['layout']}; RNG states start afresh",
                  file=sys.stderr)
    return marker["iteration"]


def main(argv: list[str] | None = None, model_provider=None, forward_step_func=None) -> dict:
    """The training program: the flags of ``argv`` (default: the command line), checked before the
    process group exists; ``model_provider`` and ``forward_step_func`` as ``train`` takes them."""
    args = parse_args(argv)
    # Before the process group: a bad argument is one clear error on every rank, not a failed
    # connection of the ranks that got past it.
    backend = "nccl" if uses_gpu(args) else "gloo"
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if missing:  # torch would say "environment variable RANK expected, but not set"
        raise ValueError(f"{' '.join(missing)} not set: launch with torchrun, e.g. torchrun --standalone "
                         "--nproc-per-node 4 examples/train_gpt.py ARGS (or ./dev.sh train ARGS)")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
    init_process_group(backend, timedelta(seconds=resolve_timeout(args)))
    try:
        log = train(args, model_provider, forward_step_func)
        if dist.get_rank() == 0 and not log["losses"]:
            print(f"nothing to do: the checkpoint is at step {log['start_step']} of --steps {args.steps}")
        elif dist.get_rank() == 0:
            write_outputs(log, args)
            print(summary(log, args))
        return log
    finally:
        dist.destroy_process_group()


def run(argv: list[str] | None = None, model_provider=None, forward_step_func=None) -> int:
    """``main`` as a program: 0 when the run ends, 2 with one ``error:`` line for what the user can
    fix (a flag, a checkpoint, a non-finite step), 1 when a rank died or stopped answering."""
    try:
        main(argv, model_provider, forward_step_func)
    except (ValueError, CheckpointingException, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except dist.DistBackendError as e:
        # A rank died or stopped answering: the collective, the group and the ranks this one waited
        # for, in one line; under torchrun also in its error file, which its "Root Cause" shows.
        print(f"error: {e}", file=sys.stderr)
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
