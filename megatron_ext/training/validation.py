"""The checks of the command line that every rank runs before the process group exists."""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from megatron_ext.dist_checkpointing import CheckpointingException
from megatron_ext.models.hf import (
    config_from_hf,
    hf_config_of,
    hf_tensor_names,
)
from megatron_ext.training import gpt_data
from megatron_ext.training.checkpointing import (
    find_checkpoint,
    latest_iteration,
    read_marker,
)
from megatron_ext.training.arguments import BYTE_VOCAB
from megatron_ext.training.model import architecture
from megatron_ext.training.validation_rules import check_rules, resolve_megatron_flags
from megatron_ext.training.validation_model import (
    apply_deepseek_defaults,
    check_gated_unit_args,
    check_hybrid_args,
    check_linear_attention_args,
    check_mla_args,
    check_moe_args,
)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Every rank runs this on the same arguments, so every rank raises the same error."""
    check_rules(args)
    resolve_megatron_flags(args)
    if args.init_model_with_meta_device and args.load_hf is not None:
        raise ValueError("--init-model-with-meta-device draws random weights; --load-hf reads them: drop one")
    args.hf_config = read_hf_config(args.load_hf) if args.load_hf is not None else None
    parts = architecture(args)
    llama_shaped = (parts["normalization"] == "RMSNorm" and parts["swiglu"] and parts["untied"]
                    and parts["position_embedding_type"] == "rope")
    if args.export_hf is not None and not llama_shaped and args.load_hf is None:
        raise ValueError("--export-hf writes Llama- or DeepSeek-shaped models: use --arch llama, --arch "
                         "deepseek or --load-hf (or --normalization RMSNorm --swiglu "
                         "--position-embedding-type rope --untie-embeddings-and-output-weights)")
    check_export_dir(args)
    if args.save is not None:
        check_writable_dir("--save", args.save)
    for flag, file in (("--log-json", args.log_json), ("--plot", args.plot)):
        if file:
            check_writable_file(flag, file)
    for flag, directory, package in (("--tensorboard-dir", args.tensorboard_dir, "tensorboard"),
                                     ("--wandb-save-dir", args.wandb_save_dir, None)):
        if directory is not None:
            check_writable_dir(flag, directory)
        if directory is not None and package and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} needs the {package} package (pip install {package})")
    if args.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb-project needs the wandb package (pip install wandb)")
    if args.hf_config is not None:
        config, kwargs = config_from_hf(args.hf_config)
        args.arch, args.layers, args.hidden = "hf", config.num_layers, config.hidden_size
        args.heads, args.num_query_groups = config.num_attention_heads, config.num_query_groups
        args.ffn_hidden, args.vocab_size = config.ffn_hidden_size, kwargs["vocab_size"]
        if config.num_moe_experts is not None:  # the experts, their width and top-k are the model's
            if args.num_experts not in (None, config.num_moe_experts):
                raise ValueError(
                    f"--num-experts {args.num_experts} differs from the --load-hf model's "
                    f"{config.num_moe_experts} experts"
                )
            args.num_experts, args.moe_router_topk = config.num_moe_experts, config.moe_router_topk
            args.moe_ffn_hidden_size = config.moe_ffn_hidden_size
            # and so are the stack, the groups and the shared experts
            args.moe_layer_freq = config.moe_layer_freq
            args.moe_router_num_groups = config.moe_router_num_groups
            args.moe_router_group_topk = config.moe_router_group_topk
            args.moe_router_topk_scaling_factor = config.moe_router_topk_scaling_factor
            args.moe_shared_expert_intermediate_size = config.moe_shared_expert_intermediate_size
        if getattr(config, "multi_latent_attention", False):
            args.multi_latent_attention = True
            if args.mtp_num_layers is None:  # the files' multi-token prediction layers are kept
                args.mtp_num_layers = hf_mtp_layers(config.num_layers, hf_tensor_names(args.load_hf))
        if args.seq_len > kwargs["max_sequence_length"]:
            raise ValueError(
                f"--seq-len {args.seq_len} exceeds the --load-hf model's {kwargs['max_sequence_length']} "
                "positions"
            )
    for name in (
        "tp",
        "cp",
        "pp",
        "layers",
        "hidden",
        "heads",
        "seq_len",
        "micro_batch_size",
        "global_batch_size",
        "steps",
        "grad_bucket_bytes",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model_parallel = args.tp * args.cp * args.pp
    if args.dp is None:
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp x cp x pp = "
                f"{args.tp} x {args.cp} x {args.pp}"
            )
        args.dp = world_size // model_parallel
    if model_parallel * args.dp != world_size:
        raise ValueError(
            f"world size {world_size} != tp x cp x pp x dp = {args.tp} x {args.cp} x {args.pp} x {args.dp}; "
            f"launch with --nproc-per-node {model_parallel * args.dp}"
        )
    check_context_parallel_args(args)
    check_attention_args(args)
    check_mla_args(args)
    apply_deepseek_defaults(args)
    check_gated_unit_args(args)
    check_moe_args(args, world_size)
    check_linear_attention_args(args)
    check_hybrid_args(args)
    if args.heads % args.tp != 0:
        raise ValueError(f"--heads {args.heads} is not divisible by --tp {args.tp}")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_len:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} is less than --seq-len "
                         f"{args.seq_len}")
    if args.hidden % args.heads != 0 and args.hf_config is None and args.kv_channels is None:
        raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.num_query_groups is not None:
        groups = args.num_query_groups
        if groups < 1 or args.heads % groups != 0:
            raise ValueError(
                f"--num-query-groups {groups} must be a positive divisor of --heads {args.heads}"
            )
        if groups % args.tp != 0 and args.tp % groups != 0:
            raise ValueError(f"--num-query-groups {groups} must be a multiple or a divisor of --tp {args.tp}")
    if args.ffn_hidden is not None and (args.ffn_hidden < 1 or args.ffn_hidden % args.tp != 0):
        raise ValueError(f"--ffn-hidden {args.ffn_hidden} must be >= 1 and divisible by --tp {args.tp}")
    width = parts["ffn_hidden"]
    if args.hf_config is None and args.ffn_hidden is None and width is not None and width % args.tp:
        raise ValueError(f"the MLP width {width} is not divisible by --tp {args.tp}; set --ffn-hidden")
    if args.hf_config is None and width is not None and width < 1:
        raise ValueError(f"the MLP width {width} of --hidden {args.hidden} is not >= 1; set --ffn-hidden")
    if args.layers % args.pp != 0:
        raise ValueError(f"--layers {args.layers} is not divisible by --pp {args.pp}")
    if args.schedule in ("zb-h1", "zb-v") and args.pp < 2:
        raise ValueError(f"--schedule {args.schedule} needs --pp >= 2")
    if args.schedule == "zb-v":
        if args.virtual_pipeline not in (None, 2):
            raise ValueError(f"--schedule zb-v runs 2 model chunks per rank, got --virtual-pipeline "
                             f"{args.virtual_pipeline}")
        args.virtual_pipeline = 2
    if args.virtual_pipeline is not None:
        if args.virtual_pipeline < 1 or args.pp < 2:
            raise ValueError(f"--virtual-pipeline {args.virtual_pipeline} needs a value >= 1 and --pp >= 2")
        if args.layers % (args.pp * args.virtual_pipeline) != 0:
            raise ValueError(
                f"--layers {args.layers} is not divisible by --pp x --virtual-pipeline = "
                f"{args.pp} x {args.virtual_pipeline}"
            )
    if args.global_batch_size % (args.micro_batch_size * args.dp) != 0:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size x dp = {args.micro_batch_size} x {args.dp}"
        )
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.dp)
    if args.schedule == "zb-v" and num_microbatches < 2 * args.pp - 1:
        raise ValueError(
            f"--schedule zb-v needs at least 2 x --pp - 1 = {2 * args.pp - 1} micro-batches per step, "
            f"got --global-batch-size / (--micro-batch-size x dp) = {num_microbatches}"
        )
    check_data_args(args)
    if args.vocab_size % args.tp != 0 or (args.tokens is None and args.vocab_size < BYTE_VOCAB):
        raise ValueError(
            f"--vocab-size {args.vocab_size} must be >= {args.tokens or BYTE_VOCAB} and divisible by "
            f"--tp {args.tp}"
        )
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 cannot be combined")
    if (args.bf16 or args.fp16) and args.dtype != "float32":
        raise ValueError(
            f"--{'bf16' if args.bf16 else 'fp16'} sets the parameter dtype; drop --dtype {args.dtype}"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
    strategy = args.data_parallel_sharding_strategy
    if strategy != "no_shard" and not args.use_megatron_fsdp:
        raise ValueError(f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp")
    if args.suggested_communication_unit_size is not None and not args.use_megatron_fsdp:
        raise ValueError("--suggested-communication-unit-size needs --use-megatron-fsdp")
    if args.init_model_with_meta_device and strategy == "no_shard":
        raise ValueError(
            "--init-model-with-meta-device needs --use-megatron-fsdp with a "
            "--data-parallel-sharding-strategy other than no_shard (the sharding wrapper draws the model)"
        )
    if strategy != "no_shard" and not args.use_distributed_optimizer:
        raise ValueError(
            f"--data-parallel-sharding-strategy {strategy} shards the optimizer state: it needs "
            "--use-distributed-optimizer"
        )
    if args.sequence_parallel and args.seq_len % args.tp != 0:
        raise ValueError(
            f"--seq-len {args.seq_len} is not divisible by --tp {args.tp} (needed by --sequence-parallel)"
        )
    if args.data is not None and os.path.isdir(args.data):
        raise ValueError(f"--data {args.data!r} is a directory; expected a text file")
    if args.data is not None and not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data!r}: no such file")
    if args.save_interval is not None and (args.save_interval < 1 or args.save is None):
        raise ValueError(f"--save-interval {args.save_interval} needs --save and must be >= 1")
    if args.skip_nonfinite and not args.check_for_nan_in_loss_and_grad:
        raise ValueError(
            "--skip-nonfinite needs the check that --no-check-for-nan-in-loss-and-grad turns off"
        )
    if args.keep_last is not None and (args.keep_last < 1 or args.save is None):
        raise ValueError(f"--keep-last {args.keep_last} needs --save and must be >= 1")
    check_checkpoint_paths(args)
    resolve_timeout(args)


def tokenizer_of(args: argparse.Namespace):
    """The run's tokenizer: Megatron-LM's NullTokenizer (--tokenizer-type NullTokenizer), or the
    Hugging Face one of ``tokenizer_dir``."""
    if args.null_tokenizer_vocab is not None:
        return gpt_data.NullTokenizer(args.null_tokenizer_vocab)
    return gpt_data.HuggingFaceTokenizer(tokenizer_dir(args))


def tokenizer_dir(args: argparse.Namespace) -> str | None:
    """--tokenizer, or the --load-hf directory when it holds a tokenizer; None: byte-level."""
    if args.tokenizer is not None:
        return args.tokenizer
    if args.load_hf is not None and any(os.path.isfile(os.path.join(args.load_hf, name))
                                        for name in gpt_data.TOKENIZER_FILES):
        return args.load_hf
    return None


def check_data_args(args: argparse.Namespace) -> None:
    """--data-path's blend and split, --sft's records and micro-batches, the tokenizer and the
    vocabulary it sizes, the evaluation flags; fills in --vocab-size."""
    if args.data is not None and args.data_path is not None:
        raise ValueError("--data (a text file) and --data-path (tokenized corpora) exclude each other")
    if args.sft is not None:
        check_sft_args(args)
    elif args.pad_seq_to_mult is not None:
        raise ValueError("--pad-seq-to-mult pads the records of --sft: it needs --sft")
    if args.data_cache_path is not None:
        if args.data_path is None:
            raise ValueError("--data-cache-path is where the index caches of --data-path go: it needs "
                             "--data-path (--data and --sft build none)")
        check_writable_dir("--data-cache-path", args.data_cache_path)
    if args.mock_data:
        if tokenizer_dir(args) is None and args.tokenizer_type != "NullTokenizer":
            raise ValueError("--mock-data needs a tokenizer (its vocabulary and end of document): "
                             "--tokenizer-type NullTokenizer --vocab-size N, or --tokenizer DIR")
        if gpt_data.split_share(args.split, "train") == 0:
            raise ValueError(f"--split {args.split!r} leaves no documents to train on")
    if args.data_path is not None:
        if tokenizer_dir(args) is None and args.tokenizer_type != "NullTokenizer":
            raise ValueError("--data-path needs the corpus's tokenizer: --tokenizer DIR, or --load-hf "
                             "with one")
        prefixes, weights = gpt_data.parse_blend(args.data_path, args.split)
        if gpt_data.split_share(args.split, "train") == 0:
            raise ValueError(f"--split {args.split!r} leaves no documents to train on")
        for prefix in prefixes:
            missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
            if missing:
                raise ValueError(f"--data-path {prefix!r}: no {' or '.join(missing)} (a tokenized corpus "
                                 "is a "
                                 "PREFIX.bin and a PREFIX.idx file)")
    if args.eval_interval is not None:
        if args.data_path is None and args.sft is None and not args.mock_data:
            raise ValueError("--eval-interval needs --data-path, --mock-data or --sft (its validation split)")
        if args.eval_interval < 1 or args.eval_iters < 1:
            raise ValueError(f"--eval-interval {args.eval_interval} and --eval-iters {args.eval_iters} "
                             "must be >= 1")
        if gpt_data.split_share(args.split, "valid") == 0:
            raise ValueError(f"--eval-interval needs a validation share in --split {args.split!r}")
    directory = tokenizer_dir(args)
    tokens = tokenizer_of(args).vocab_size if directory is not None or args.null_tokenizer_vocab else None
    if args.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by must be >= 1, got {args.make_vocab_size_divisible_by}")
    if args.hf_config is not None:  # the model's vocabulary is the Hugging Face config's
        if tokens is not None and tokens > args.vocab_size:
            raise ValueError(f"the tokenizer in {directory!r} has {tokens} tokens, more than the --load-hf "
                             f"model's vocabulary of {args.vocab_size}")
    elif args.vocab_size is None:
        args.vocab_size = BYTE_VOCAB if tokens is None else gpt_data.padded_vocab_size(
            tokens, args.make_vocab_size_divisible_by, args.tp)
    elif tokens is not None and args.vocab_size < tokens:
        raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokens} tokens")
    args.tokens = tokens  # the vocabulary the data's ids must lie in (None: bytes)


def check_sft_args(args: argparse.Namespace) -> None:
    """--sft: the only data source, a file, a tokenizer, records to train on, one packed row per
    micro-batch."""
    others = [flag for flag, value in (("--data", args.data), ("--data-path", args.data_path))
              if value is not None]
    if others:
        raise ValueError(f"--sft (prompt/response records) and {' and '.join(others)} exclude each other: "
                         "one data source per run")
    if not os.path.isfile(args.sft):
        raise ValueError(f"--sft {args.sft!r}: no such file (expected JSONL prompt/response records)")
    if tokenizer_dir(args) is None:
        raise ValueError("--sft needs the tokenizer of its records: --tokenizer DIR, or --load-hf with one")
    if gpt_data.split_share(args.split, "train") == 0:
        raise ValueError(f"--split {args.split!r} leaves no records to train on")
    if args.micro_batch_size != 1:
        # Megatron-core's packed (thd) format is one row of several sequences with its own
        # boundaries; a second row would need boundaries of its own.
        raise ValueError(f"--sft feeds one packed row of sequences per micro-batch (Megatron-core's thd "
                         f"format: batch 1, cu_seqlens over the row): use --micro-batch-size 1, got "
                         f"{args.micro_batch_size}")
    if args.pad_seq_to_mult is None:
        args.pad_seq_to_mult = 1
    if args.pad_seq_to_mult < 1:
        raise ValueError(f"--pad-seq-to-mult must be >= 1, got {args.pad_seq_to_mult}")
    # The padding multiple is the data's, never this run's layout: a default of 2 x --cp would pack
    # other rows at each cp and make the runs (and resumptions across cp) train different batches.
    if args.cp > 1 and args.pad_seq_to_mult % (2 * args.cp):
        raise ValueError(
            f"--sft at --cp {args.cp} splits every record into 2 x --cp = {2 * args.cp} chunks: give "
            f"--pad-seq-to-mult a multiple of {2 * args.cp}, got {args.pad_seq_to_mult} (the same value at "
            "every layout the run trains or resumes at, so that all train the same rows)"
        )


def check_writable_dir(flag: str, path: str) -> None:
    """``path`` is a directory, or can be made one: its nearest existing ancestor is a writable
    directory."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is not a directory")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    target = path if os.path.isdir(path) else ancestor
    if not os.path.isdir(target):
        raise ValueError(f"{flag} {path!r} cannot be created: {target!r} is not a directory")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: {target!r} is not writable")


def check_writable_file(flag: str, path: str) -> None:
    """``path`` is a file that can be written: not a directory, and its directory is one or can be
    made."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; expected the path of a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path!r} is not writable")
    check_writable_dir(f"{flag} {path!r}: its directory", os.path.dirname(os.path.abspath(path)))


def check_export_dir(args: argparse.Namespace) -> None:
    """--export-hf: a new or empty directory (or one to replace, when asked), never the model
    --load-hf reads."""
    if args.export_hf is None:
        if args.export_hf_overwrite:
            raise ValueError("--export-hf-overwrite needs --export-hf")
        return
    check_writable_dir("--export-hf", args.export_hf)
    if args.load_hf is not None and os.path.realpath(args.export_hf) == os.path.realpath(args.load_hf):
        raise ValueError(
            f"--export-hf {args.export_hf!r} is the --load-hf directory: exporting would overwrite the "
            "model this run starts from; export to another directory"
        )
    for flag, checkpoints in (("--save", args.save), ("--load", args.load)):
        if checkpoints is not None and os.path.realpath(args.export_hf) == os.path.realpath(checkpoints):
            raise ValueError(
                f"--export-hf {args.export_hf!r} is the {flag} directory: the Hugging Face model would "
                "lie among the checkpoints; export to another directory"
            )
    if os.path.isdir(args.export_hf) and os.listdir(args.export_hf) and not args.export_hf_overwrite:
        names = sorted(os.listdir(args.export_hf))
        raise ValueError(
            f"--export-hf {args.export_hf!r} is not empty ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}): choose a new directory, or pass "
            "--export-hf-overwrite to replace the model in it"
        )


def check_context_parallel_args(args: argparse.Namespace) -> None:
    """What --cp needs: whole chunks, whole heads per rank for a2a, no attention dropout."""
    if args.cp == 1:
        return
    if args.seq_len % (2 * args.cp) != 0:
        raise ValueError(
            f"--seq-len {args.seq_len} is not divisible by 2 x --cp = {2 * args.cp} (each sequence is cut "
            "into 2 x cp chunks)"
        )
    if args.cp_comm_type == "a2a":
        groups = args.num_query_groups or args.heads
        heads, groups = args.heads // args.tp, max(groups // args.tp, 1)
        if heads % args.cp or groups % args.cp:
            raise ValueError(
                f"--cp-comm-type a2a splits each tensor-parallel rank's {heads} query heads and {groups} "
                f"key/value groups over --cp {args.cp} ranks; both must be divisible by it"
            )
    attention_dropout = args.dropout if args.attention_dropout is None else args.attention_dropout
    if attention_dropout > 0:
        flag = "--dropout" if args.attention_dropout is None else "--attention-dropout"
        raise ValueError(f"{flag} {attention_dropout} with --cp {args.cp}: attention dropout is not "
                         "supported with context parallelism")


def check_attention_args(args: argparse.Namespace) -> None:
    """--window-size, --window-attn-skip-freq and --softmax-type: a positive window, a pattern with
    one entry per layer, and none of them with --load-hf (the model's config says)."""
    flags_set = args.window_size is not None or args.window_attn_skip_freq is not None
    if args.hf_config is not None and (flags_set or args.softmax_type != "vanilla"):
        raise ValueError("--window-size, --window-attn-skip-freq and --softmax-type come from the --load-hf "
                         "model's config; drop them")
    no_hf_config = args.softmax_type != "vanilla" or args.window_attn_skip_freq is not None
    if args.export_hf is not None and no_hf_config:
        raise ValueError("--export-hf writes Llama or Mistral configs, which have no attention sinks "
                         "(--softmax-type) and no windows on some layers only (--window-attn-skip-freq)")
    if args.window_size is not None and args.window_size < 1:
        raise ValueError(f"--window-size must be >= 1 (the tokens a query sees, itself included), got "
                         f"{args.window_size}")
    freq = args.window_attn_skip_freq
    if freq is None:
        return
    if args.window_size is None:
        raise ValueError("--window-attn-skip-freq needs --window-size")
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"--window-attn-skip-freq must be >= 1, got {freq}")
    if isinstance(freq, list) and (len(freq) != args.layers or set(freq) - {0, 1}):
        raise ValueError(f"--window-attn-skip-freq {freq} must list 0 or 1 for each of the --layers "
                         f"{args.layers} layers")


def read_hf_config(path: str) -> dict:
    """--load-hf's config.json, whose shape replaces the model arguments, after checking that the
    directory's safetensors files (and index) are readable and one model."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"--load-hf {path!r} holds no config.json; expected a Hugging Face model directory")
    try:
        hf_config = hf_config_of(path)
        config, kwargs = config_from_hf(hf_config)  # refuses what it cannot map
        hf_tensor_names(path)
    except (ValueError, NotImplementedError, OSError) as e:
        raise ValueError(f"--load-hf {path!r}: {e}") from None
    if kwargs["vocab_size"] < BYTE_VOCAB:
        raise ValueError(
            f"--load-hf {path!r}: a vocabulary of {kwargs['vocab_size']} < {BYTE_VOCAB} tokens cannot "
            "hold the byte-level data"
        )
    return hf_config


def check_checkpoint_paths(args: argparse.Namespace) -> None:
    """--load names a checkpoint, or nothing only where training from scratch is meant; --save
    holds nothing newer than where this run starts. The files are the same for every rank."""
    start = 0
    if args.load is not None:
        if os.path.exists(args.load) and not os.path.isdir(args.load):
            raise ValueError(
                f"--load {args.load!r} is not a directory; expected a checkpoint or a --save directory"
            )
        resolved = find_checkpoint(args.load)
        own_saves = args.save is not None and os.path.realpath(args.save) == os.path.realpath(args.load)
        if resolved is None and not (own_saves or (args.allow_fresh_start and os.path.isdir(args.load))):
            found = "does not exist" if not os.path.exists(args.load) else "holds no checkpoint"
            raise ValueError(
                f"--load {args.load!r} {found}; to train from scratch, name it as --save too (a run that "
                f"resumes from its own saves)"
                + (" or pass --allow-fresh-start" if found != "does not exist" else "")
            )
        if resolved is not None:
            try:
                start = read_marker(resolved)["iteration"]
            except CheckpointingException:
                pass  # loading reports it, on every rank
    newest = latest_iteration(args.save) if args.save is not None else None
    if newest is not None and newest > start and not args.allow_overwrite:
        raise ValueError(
            f"--save {args.save!r} holds iteration {newest}, newer than the iteration {start} this run "
            "starts "
            f"from: its saves would overwrite newer checkpoints. Resume them with --load {args.save}, choose "
            f"another --save directory, or pass --allow-overwrite"
        )


def uses_gpu(args: argparse.Namespace) -> bool:
    """Whether this run puts its model on a GPU (NCCL); refuses --device cuda without one."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA GPU")
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def resolve_timeout(args: argparse.Namespace) -> float:
    """--timeout, its default filled in: 120 s on CPU, 600 s on GPUs (NCCL's watchdog ends the
    process when a collective outlasts it, and a first NCCL connection or a large save can take long)."""
    if args.timeout is None:
        args.timeout = 600.0 if uses_gpu(args) else 120.0
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    return args.timeout


def hf_mtp_layers(num_layers: int, names: list[str]) -> int | None:
    """The multi-token prediction layers a DeepSeek-V3 checkpoint holds (after its decoder layers)."""
    depth = 0
    while f"model.layers.{num_layers + depth}.eh_proj.weight" in names:
        depth += 1
    return depth or None
