"""The training program's command line: every flag under Megatron-LM's name where it has one
(the short names of the first version kept as aliases), ``--config FILE`` (YAML or TOML) holding any
of them, and one ``error:`` line for a flag that is not one (naming the Megatron-LM flags that
megatron_ext does not implement as such)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_ext.distributed.distributed_data_parallel import DEFAULT_BUCKET_SIZE_BYTES
from megatron_ext.training.arguments_model import add_model_arguments
from megatron_ext.training.config_file import config_argv

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
BYTE_VOCAB = 256
DESCRIPTION = """Trains a GPT with tensor x pipeline x context x expert x data parallelism.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2

The number of processes must equal tp x cp x pp x dp (dp is inferred when not given). Every flag is
also accepted in a --config file (YAML or TOML); the command line overrides it."""
# The option names Megatron-LM's pretrain_gpt.py accepts: those megatron_ext lacks are refused by name.
MEGATRON_LM_FLAGS_FILE = os.path.join(os.path.dirname(__file__), "megatron_lm_flags.txt")


# Megatron-LM's switches between implementations of the same computation: accepted, as megatron_ext
# computes it one way whichever is named (docs/training_cli.md lists them).
_ON = {"action": "store_true"}
SAME_NUMBERS_FLAGS = (
    ("--use-mcore-models", _ON, "megatron_ext's models are Megatron-core's"),
    ("--transformer-impl", {"choices": ["local", "transformer_engine"], "default": "transformer_engine"},
     "megatron_ext has one implementation of the layers"),
    ("--attention-backend", {"choices": ["flash", "fused", "unfused", "local", "auto"], "default": "auto"},
     "megatron_ext has one attention kernel per device"),
    ("--use-flash-attn", _ON, "megatron_ext has one attention kernel per device"),
    ("--no-masked-softmax-fusion", _ON, "the softmax is megatron_ext's own kernel either way"),
    ("--no-rope-fusion", _ON, "the rotary embedding is megatron_ext's own kernel either way"),
    ("--no-gradient-accumulation-fusion", _ON, "the weight gradients accumulate the same either way"),
    ("--cross-entropy-loss-fusion", _ON, "the vocabulary-parallel cross-entropy is one fused op here"),
    ("--overlap-grad-reduce", _ON, "the data-parallel gradient reduction always overlaps the backward here"),
    ("--no-position-embedding", _ON, "deprecated in Megatron-LM; the positions are "
     "--position-embedding-type's"),
    ("--log-throughput", _ON, "tokens/s is always logged"),
    ("--log-memory-to-tensorboard", _ON, "with --tensorboard-dir the memory is always written"),
    ("--log-validation-ppl-to-tensorboard", _ON, "with --tensorboard-dir the validation perplexity is "
     "always written"),
    ("--no-mmap-bin-files", _ON, "the corpora are read through memory maps either way, with the same tokens"),
    ("--no-create-attention-mask-in-dataloader", _ON, "no batch carries an attention mask here"),
    ("--num-workers", {"type": int, "default": 2}, "the batches are read in the training process"),
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one ValueError (the program prints it as one ``error:``
    line and exits 2) instead of the usage text and SystemExit."""

    def error(self, message: str):
        raise ValueError(message)


def megatron_lm_flags() -> set[str]:
    with open(MEGATRON_LM_FLAGS_FILE) as f:
        return {line.strip() for line in f if line.startswith("--")}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML or TOML file of flags (keys: the flags' names without the dashes, "
                   "optionally in sections); the command line overrides it")
    add_model_arguments(p)
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="tensor-parallel size")
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1,
                   help="pipeline-parallel size")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: world / (tp x cp x pp))")
    p.add_argument("--context-parallel-size", "--cp", dest="cp", type=int, default=1,
                   help="context-parallel size: each sequence split over cp ranks (2 x cp chunks, rank r "
                        "holding chunks r and 2cp-1-r)")
    p.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a"], default="p2p",
                   help="context-parallel attention: p2p (ring), all_gather (K/V gathered), a2a (Ulysses)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--train-iters", "--steps", dest="steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: one GPU per process over NCCL; cpu: gloo; auto: cuda when a GPU is present")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "zb-h1", "zb-v"], default="1f1b",
                   help="zb-h1 / zb-v: the zero-bubble schedules (backward split into input and "
                        "weight halves); zb-v runs two model chunks per rank in a V")
    p.add_argument("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline", dest="virtual_pipeline",
                   type=int, default=None,
                   help="model chunks per pipeline stage: the interleaved 1F1B schedule (needs --pp >= 2)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="shard LayerNorm/dropout activations along the sequence over the tensor-parallel group",
    )
    p.add_argument("--grad-bucket-bytes", type=int, default=DEFAULT_BUCKET_SIZE_BYTES,
                   help="size bound of a data-parallel gradient all-reduce bucket")
    p.add_argument(
        "--bf16", action="store_true", help="bf16 model parameters, float32 main parameters and gradients"
    )
    p.add_argument("--fp16", action="store_true",
                   help="fp16 model parameters, float32 main parameters and gradients, dynamic loss scaling")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the main parameters and Adam state over the data-parallel group")
    p.add_argument("--use-megatron-fsdp", action="store_true",
                   help="wrap each model chunk in FullyShardedDataParallel "
                        "(with --data-parallel-sharding-strategy)")
    p.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="with --use-megatron-fsdp: what is sharded over the data-parallel group (optimizer "
                        "state; and gradients; and parameters)")
    p.add_argument("--suggested-communication-unit-size", type=int, default=None,
                   help="with --use-megatron-fsdp: the most elements a unit may gather at once")
    p.add_argument("--init-model-with-meta-device", action="store_true",
                   help="with --use-megatron-fsdp and a sharding strategy: build the model without storage "
                        "and draw it unit by unit as it is sharded (the same weights)")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: overlap the all-gather of the updated parameters "
                        "with the next forward")
    p.add_argument("--clip-grad", type=float, default=0.0, help="clip gradients to this global norm (0: off)")
    p.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW weight decay (not on biases/LayerNorms)"
    )
    p.add_argument(
        "--data", default=None, help="a text file (byte-level, or tokenized with --load-hf's tokenizer); "
        "default: Python's standard library sources"
    )
    p.add_argument("--data-path", nargs="+", default=None,
                   help="[W1] PREFIX1 [W2 PREFIX2 ...]: tokenized .bin/.idx corpora, blended by weight "
                   "(python -m megatron_ext.datasets.preprocess writes them); needs --tokenizer or --load-hf")
    p.add_argument("--sft", default=None, metavar="JSONL",
                   help="supervised fine-tuning on a JSONL file of {\"prompt\": ..., \"response\": ...} "
                   "records, packed several to a row, the loss on the response tokens only (per token over "
                   "the global batch); needs --tokenizer or --load-hf, and --micro-batch-size 1 (one packed "
                   "row per micro-batch)")
    p.add_argument("--pad-seq-to-mult", type=int, default=None, metavar="N",
                   help="with --sft: pad every record to a multiple of N tokens (default 1; at --cp > 1 a "
                   "multiple of 2 x --cp). The rows depend on N, not on the layout: give a run and its "
                   "resumptions at other layouts the same N, e.g. 2 x the largest --cp they use")
    p.add_argument("--split", default="969,30,1",
                   help="with --data-path: the train,valid,test shares of each corpus's documents; with "
                   "--sft: of the records")
    p.add_argument("--tokenizer-model", "--tokenizer", dest="tokenizer", default=None,
                   help="a Hugging Face tokenizer directory: its vocabulary sizes the model (default with "
                   "--load-hf: the model directory's tokenizer)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="with --tokenizer: the model's vocabulary is the tokenizer's rounded up to a "
                   "multiple "
                   "of this x --tp")
    p.add_argument("--data-cache-path", default=None,
                   help="where the dataset index caches go (default: "
                   "PREFIX's directory/cache/GPTDataset_indices)")
    p.add_argument("--eval-interval", type=int, default=None,
                   help="with --data-path or --sft: the validation loss every this many steps")
    p.add_argument("--eval-iters", type=int, default=10,
                   help="global batches of the validation split per evaluation")
    p.add_argument(
        "--log-json",
        default=None,
        help="append JSON lines here as the run goes: each attempt's start (config, the iteration it "
        "resumed from), every step (loss, tokens/s, grad norm), each save and the end",
    )
    p.add_argument(
        "--plot", default="runs/train_gpt_loss.png", help="PNG loss curve written by rank 0 ('' = none)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective may wait before failing (default: 120 on CPU; 600 on GPUs, where "
        "NCCL's watchdog ends the process instead)",
    )
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, default=1,
                   help="expert-parallel size (the experts split over it)")
    p.add_argument("--expert-tensor-parallel-size", "--etp", dest="etp", type=int, default=None,
                   help="expert-tensor-parallel size (each expert's MLP split over it; default: --tp)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--save", default=None, help="directory to save checkpoints in (also after the last step)")
    p.add_argument("--save-interval", type=int, default=None, help="save every this many steps")
    p.add_argument(
        "--load",
        default=None,
        help="checkpoint (or --save directory) to resume from, at any valid layout; a path with no "
        "checkpoint is an error unless it is the --save directory or --allow-fresh-start is given",
    )
    p.add_argument("--allow-fresh-start", action="store_true",
                   help="with --load: train from scratch when that directory holds no checkpoint")
    p.add_argument(
        "--allow-overwrite",
        action="store_true",
        help="save even where --save holds a newer iteration than this run starts from (overwriting "
        "it and moving the tracker back)",
    )
    p.add_argument("--keep-last", type=int, default=None,
                   help="after each save, remove all but the newest this many checkpoints in --save")
    p.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="do not check each step's loss and gradients for NaN and Inf before the update")
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip (on every rank) a step whose loss or gradients are not finite, instead of stopping",
    )
    p.add_argument(
        "--load-hf",
        default=None,
        help="start from Hugging Face weights: a directory with config.json and safetensors files "
        "(Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3, gpt-oss; "
        "its multi-token prediction layers too, when the files hold them); the model's shape comes from its "
        "config.json, not from --arch --layers --hidden --heads --num-query-groups --ffn-hidden "
        "--vocab-size (nor, for a mixture of experts, --num-experts --moe-router-topk "
        "--moe-ffn-hidden-size)",
    )
    p.add_argument("--export-hf", default=None,
                   help="after training, write the weights as Hugging Face safetensors + config.json to this "
                        "directory (Llama-shaped models: --arch llama, Mixtral with --num-experts, "
                        "--arch deepseek, or --load-hf); it must be new or empty unless "
                        "--export-hf-overwrite, and never the --load-hf, --save or --load directory")
    p.add_argument("--export-hf-overwrite", action="store_true",
                   help="with --export-hf: replace the model in that directory (its config.json, "
                        "*.safetensors and index are removed first)")
    p.add_argument("--no-load-rng", action="store_true", help="with --load, keep the fresh random states")
    p.add_argument("--no-load-optim", action="store_true", help="with --load, keep the fresh optimizer state")
    p.add_argument("--min-lr", type=float, default=0.0, help="the learning rate the decay ends at")
    p.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="constant", help="the learning rate after the warm-up (Megatron-LM's default is "
                   "linear)")
    p.add_argument("--lr-decay-iters", type=int, default=None,
                   help="steps the decay lasts (default: --train-iters)")
    p.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="steps of linear warm-up from --lr-warmup-init to --lr")
    p.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="the warm-up as a share of --lr-decay-iters (instead of --lr-warmup-iters)")
    p.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="the learning rate the warm-up starts at")
    p.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential", help="with --lr-decay-style WSD: the shape of its final decay")
    p.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="with --lr-decay-style WSD: the steps of its final decay")
    p.add_argument("--start-weight-decay", type=float, default=None,
                   help="the weight decay at the first step (default: --weight-decay)")
    p.add_argument("--end-weight-decay", type=float, default=None,
                   help="the weight decay at the last step (default: --weight-decay)")
    p.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="how the weight decay goes from --start-weight-decay to --end-weight-decay")
    p.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    p.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")
    p.add_argument("--log-interval", type=int, default=None,
                   help="print a line (step, loss, learning rate, grad norm, tokens/s) every this many steps "
                   "instead of the progress bar")
    p.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars here (loss, validation loss and perplexity, learning "
                   "rate, "
                   "grad norm, tokens/s, loss scale, MoE and MTP losses, memory); needs the tensorboard "
                   "package")
    p.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="with --tensorboard-dir: the scalars of every this many steps")
    p.add_argument("--wandb-project", default=None,
                   help="log the same scalars to this Weights & Biases project; needs the wandb package")
    p.add_argument("--wandb-exp-name", default=None, help="with --wandb-project: the run's name")
    p.add_argument("--wandb-save-dir", default=None, help="with --wandb-project: wandb's local directory")
    p.add_argument("--distributed-timeout-minutes", type=float, default=None,
                   help="--timeout in minutes, Megatron-LM's name (the two exclude each other)")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk: the same as --virtual-pipeline --num-layers / (--pp x this)")
    p.add_argument("--tokenizer-type", choices=["HuggingFaceTokenizer", "NullTokenizer"], default=None,
                   help="HuggingFaceTokenizer: --tokenizer-model's (the default when one is given); "
                   "NullTokenizer: no tokenizer, the ids 0 to --vocab-size - 1 and an end-of-document id "
                   "--vocab-size (with --mock-data)")
    p.add_argument("--mock-data", action="store_true",
                   help="Megatron-core's MockGPTDataset: synthetic documents (each 1, 2, 3, ... then the "
                   "end-of-document id) in the place of --data-path")
    p.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist",
                   help="the checkpoints' format: Megatron-core's torch_dist (the only one here)")
    for flag, kwargs, why in SAME_NUMBERS_FLAGS:
        p.add_argument(flag, **kwargs, help=f"accepted: {why}")
    # --load-hf's config.json, and the NullTokenizer's --vocab-size, as check_args records them
    p.set_defaults(hf_config=None, null_tokenizer_vocab=None)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line) after those of its ``--config`` file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    config = [i for i, token in enumerate(argv) if token == "--config" or token.startswith("--config=")]
    if len(config) > 1:
        raise ValueError("--config is given more than once: one file per run, the command line overrides it")
    if config:
        i = config[0]
        if argv[i] == "--config":
            if i + 1 == len(argv):
                raise ValueError("argument --config: expected one argument")
            path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        else:
            path, argv = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
        argv = config_argv(path, parser) + argv
    args, unknown = parser.parse_known_args(argv)
    flags = [token.split("=", 1)[0] for token in unknown if token.startswith("-")]
    if flags:
        megatron = megatron_lm_flags()
        lacking = [flag for flag in flags if flag in megatron]
        if lacking:
            raise ValueError(f"{' '.join(lacking)}: Megatron-LM flag{'s' if len(lacking) > 1 else ''} that "
                             "megatron_ext does not implement (docs/training_cli.md lists the flags it has)")
        raise ValueError(f"unrecognized argument{'s' if len(flags) > 1 else ''} {' '.join(flags)} "
                         "(docs/training_cli.md lists the flags)")
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
    return args
