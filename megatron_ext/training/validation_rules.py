"""The command line's rules as data: each number's bounds, the flags that need or exclude others, the
model flags a --load-hf model decides; and Megatron-LM's spellings of a setting resolved into the
one the program reads (--distributed-timeout-minutes, --num-layers-per-virtual-pipeline-stage,
--group-query-attention, --tokenizer-type)."""

from __future__ import annotations

import argparse

import torch

from megatron_ext.optimizer import OptimizerConfig

# The float flags: each finite (and in float32's range, where the optimizer takes it as a float32
# scalar) and within its bounds. NaN passes no comparison, so every check is written as what holds.
FLOAT32_MAX = torch.finfo(torch.float32).max
# Adam's first step moves the weights by --lr / (1 - beta1), a float32 scalar: at most FLOAT32_MAX.
LR_MAX = FLOAT32_MAX * (1 - OptimizerConfig.adam_beta1)

# flag: (low, high, low included, high included); a flag left unset (None) is not checked.
FLOAT_BOUNDS = {
    "--lr": (0.0, LR_MAX, True, True),
    "--min-lr": (0.0, LR_MAX, True, True),
    "--lr-warmup-init": (0.0, LR_MAX, True, True),
    "--lr-warmup-fraction": (0.0, 1.0, True, True),
    "--clip-grad": (0.0, FLOAT32_MAX, True, True),
    "--weight-decay": (0.0, FLOAT32_MAX, True, True),
    "--start-weight-decay": (0.0, FLOAT32_MAX, True, True),
    "--end-weight-decay": (0.0, FLOAT32_MAX, True, True),
    "--adam-beta1": (0.0, 1.0, True, False),
    "--adam-beta2": (0.0, 1.0, True, False),
    "--adam-eps": (0.0, FLOAT32_MAX, False, True),
    "--dropout": (0.0, 1.0, True, False),
    "--hidden-dropout": (0.0, 1.0, True, False),
    "--attention-dropout": (0.0, 1.0, True, False),
    "--init-method-std": (0.0, FLOAT32_MAX, False, True),
    "--norm-epsilon": (0.0, 1.0, False, True),
    "--rotary-percent": (0.0, 1.0, False, True),
}
# Integer flags that must be >= 1 when given (those with defaults are checked by check_args).
POSITIVE_INTS = ("--max-position-embeddings", "--kv-channels", "--rotary-base", "--lr-decay-iters",
                 "--lr-wsd-decay-iters", "--log-interval", "--tensorboard-log-interval",
                 "--num-layers-per-virtual-pipeline-stage")
# (flag, what it needs): a flag that only means something beside another; the need as a test of args.
NEEDS = (
    ("--wandb-exp-name", "--wandb-project", lambda a: a.wandb_project is not None),
    ("--wandb-project", "--wandb-exp-name (the run's name)", lambda a: a.wandb_exp_name is not None),
    ("--wandb-save-dir", "--wandb-project", lambda a: a.wandb_project is not None),
    ("--tensorboard-log-interval", "--tensorboard-dir", lambda a: a.tensorboard_dir is not None),
    ("--lr-wsd-decay-iters", "--lr-decay-style WSD", lambda a: a.lr_decay_style == "WSD"),
    ("--min-lr", "a decaying --lr-decay-style (not constant)", lambda a: a.lr_decay_style != "constant"),
    ("--start-weight-decay", "--weight-decay-incr-style linear or cosine (constant: --weight-decay)",
     lambda a: a.weight_decay_incr_style != "constant"),
    ("--end-weight-decay", "--weight-decay-incr-style linear or cosine (constant: --weight-decay)",
     lambda a: a.weight_decay_incr_style != "constant"),
    ("--weight-decay-incr-style linear", "--start-weight-decay and --end-weight-decay",
     lambda a: a.start_weight_decay is not None and a.end_weight_decay is not None),
    ("--weight-decay-incr-style cosine", "--start-weight-decay and --end-weight-decay",
     lambda a: a.start_weight_decay is not None and a.end_weight_decay is not None),
    ("--tokenizer-type NullTokenizer", "--mock-data or --data-path (it has no text to tokenize)",
     lambda a: a.mock_data or a.data_path is not None),
)
# (flag, flag): the pairs that exclude each other.
EXCLUDES = (
    ("--timeout", "--distributed-timeout-minutes"),
    ("--add-bias-linear", "--disable-bias-linear"),
    ("--virtual-pipeline", "--num-layers-per-virtual-pipeline-stage"),
    ("--lr-warmup-iters", "--lr-warmup-fraction"),
    ("--mock-data", "--data"),
    ("--mock-data", "--data-path"),
    ("--mock-data", "--sft"),
    ("--mock-data", "--load-hf"),
)
# The model flags whose setting a --load-hf model's config.json holds: given with it, refused.
LOAD_HF_MODEL_FLAGS = ("--max-position-embeddings", "--kv-channels", "--normalization", "--norm-epsilon",
                       "--swiglu", "--position-embedding-type", "--untie-embeddings-and-output-weights",
                       "--disable-bias-linear", "--qk-layernorm", "--group-query-attention")
# Flags whose default is not "unset" (None / False / 0): their defaults, to tell whether one is given.
DEFAULTS = {"--rotary-base": 10000, "--rotary-percent": 1.0, "--init-method-std": 0.02,
            "--lr-decay-style": "constant", "--tensorboard-log-interval": 1, "--lr-warmup-iters": 0,
            "--min-lr": 0.0, "--lr-warmup-init": 0.0}


def value_of(args: argparse.Namespace, flag: str):
    """The value of ``flag`` (``--name`` or ``--name VALUE``, the latter read as "equals VALUE")."""
    name, _, wanted = flag.partition(" ")
    value = getattr(args, name[2:].replace("-", "_"))
    return (value == wanted) if wanted else value


def given(args: argparse.Namespace, flag: str) -> bool:
    """Whether ``flag`` was set to something other than its default."""
    value = value_of(args, flag)
    return value not in (None, False) and value != DEFAULTS.get(flag.partition(" ")[0], None)


def check_rules(args: argparse.Namespace) -> None:
    """The tables above, in order: bounds, needs, exclusions, the --load-hf model's flags."""
    for flag, (low, high, low_in, high_in) in FLOAT_BOUNDS.items():
        value = value_of(args, flag)
        if value is None:
            continue
        if not ((low <= value if low_in else low < value) and (value <= high if high_in else value < high)):
            bounds = ("[" if low_in else "(") + f"{low:g}, {high:g}" + ("]" if high_in else ")")
            raise ValueError(f"{flag} must be a finite number in {bounds}, got {value}")
    for flag, unit in (("--timeout", "seconds"), ("--distributed-timeout-minutes", "minutes")):
        value = value_of(args, flag)
        if value is not None and not 0 < value < 1e9:
            raise ValueError(f"{flag} must be a positive finite number of {unit}, got {value}")
    for flag in POSITIVE_INTS:
        value = value_of(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.lr_warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    decay = args.lr_decay_iters or args.steps
    warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_iters
    if warmup >= decay:
        flag = "--lr-warmup-fraction" if args.lr_warmup_fraction is not None else "--lr-warmup-iters"
        raise ValueError(f"{flag} gives a warm-up of {warmup:g} steps, not shorter than the decay's {decay} "
                         "(--lr-decay-iters, default --train-iters)")
    for flag, need, holds in NEEDS:
        if given(args, flag) and not holds(args):
            raise ValueError(f"{flag} needs {need}")
    for first, second in EXCLUDES:
        if given(args, first) and given(args, second):
            raise ValueError(f"{first} and {second} exclude each other: give one")
    if args.load_hf is not None:
        taken = [flag for flag in LOAD_HF_MODEL_FLAGS + ("--rotary-base", "--rotary-percent",
                                                         "--init-method-std") if given(args, flag)]
        if taken:
            raise ValueError(f"{' '.join(taken)}: the --load-hf model's config.json defines the model (and "
                             "its weights their initialisation); drop them")


def resolve_megatron_flags(args: argparse.Namespace) -> None:
    """Megatron-LM's spellings of settings the program reads under another: the timeout in
    minutes, the model chunks by their layers, grouped-query attention's switch (1 group when no
    count is given, Megatron-LM's default) and the tokenizer's type."""
    if args.distributed_timeout_minutes is not None:
        args.timeout, args.distributed_timeout_minutes = args.distributed_timeout_minutes * 60, None
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        if args.layers % (args.pp * per_chunk):
            raise ValueError(f"--num-layers {args.layers} is not divisible by --pipeline-model-parallel-size "
                             f"x --num-layers-per-virtual-pipeline-stage = {args.pp} x {per_chunk}")
        args.virtual_pipeline = args.layers // (args.pp * per_chunk)
        args.num_layers_per_virtual_pipeline_stage = None
    if args.tp == 1:  # as Megatron-LM: nothing to split the sequence over
        args.sequence_parallel = False
    if args.group_query_attention and args.num_query_groups is None:
        args.num_query_groups = 1
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer is None and args.load_hf is None:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a Hugging Face "
                         "tokenizer directory)")
    if args.tokenizer_type == "NullTokenizer":
        if args.tokenizer is not None:
            raise ValueError("--tokenizer-type NullTokenizer has no model: drop --tokenizer-model")
        if args.null_tokenizer_vocab is None:  # the first check: --vocab-size is the tokenizer's
            if args.vocab_size is None:
                raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size (its ids are 0 to "
                                 "--vocab-size - 1, and --vocab-size its end of document)")
            args.null_tokenizer_vocab, args.vocab_size = args.vocab_size, None
