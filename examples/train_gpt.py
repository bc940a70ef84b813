"""Trains a small byte-level GPT with tensor x pipeline x data parallelism.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2

The number of processes must equal tp x pp x dp (dp is inferred when not given). Every layout
trains the same model on the same global batches: with the same seed and global batch the
per-step losses agree across layouts (exactly, up to rounding, in float64).
"""

from __future__ import annotations

import argparse
import ast
import functools
import glob
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.comm_errors import reported
from megatron_ext.dist_checkpointing import CheckpointingException
from megatron_ext.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_ext.distributed.distributed_data_parallel import DEFAULT_BUCKET_SIZE_BYTES
from megatron_ext.fusions.fused_bias_geglu import quick_gelu
from megatron_ext.models import GPTModel
from megatron_ext.models.hf import (
    config_from_hf,
    export_hf_state_dict,
    hf_config_dict,
    hf_config_of,
    hf_tensor_names,
    load_hf_state_dict,
)
from megatron_ext.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_ext.training import gpt_data
from megatron_ext.pipeline_parallel import get_forward_backward_func
from megatron_ext.tensor_parallel.utils import comm_device
from megatron_ext.training.checkpointing import (
    find_checkpoint,
    latest_iteration,
    load_checkpoint,
    read_marker,
    save_checkpoint,
)
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron_ext.transformer.transformer_config import MLATransformerConfig
from megatron_ext.transformer.transformer_layer import is_moe_layer
from megatron_ext.transformer.transformer_config import check_group_limited_routing
from megatron_ext.transformer.moe.router_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics
from megatron_ext.utils import get_batch_on_this_cp_rank, get_thd_batch_on_this_cp_rank

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
BYTE_VOCAB = 256
DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024


def window_pattern(text: str) -> int | list[int]:
    """--window-attn-skip-freq: an int, or a list literal of 0/1 entries."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(x, int) for x in value):
        return value
    raise argparse.ArgumentTypeError(f"expected an int or a list such as [1,0,1,0], got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: world / (tp x cp x pp))")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each sequence split over cp ranks (2 x cp chunks, rank r "
                        "holding chunks r and 2cp-1-r)")
    p.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a"], default="p2p",
                   help="context-parallel attention: p2p (ring), all_gather (K/V gathered), a2a (Ulysses)")
    p.add_argument(
        "--arch",
        choices=["gpt", "llama", "deepseek"],
        default="gpt",
        help="gpt: LayerNorm, biased linears, GeLU, learned positions, tied output layer; llama: "
        "RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied output layer; "
        "deepseek: llama's with DeepSeek's norm epsilon 1e-6, multi-latent attention and, with "
        "--num-experts, DeepSeek-V3's experts (sigmoid routing with the expert bias, a dense first layer, "
        "one shared expert)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads for grouped-query attention (default: --heads)")
    p.add_argument(
        "--ffn-hidden",
        type=int,
        default=None,
        help="MLP width (default: 4 x --hidden for gpt, 8/3 x --hidden rounded up to a multiple of "
        "32 for llama)",
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--window-size", type=int, default=None,
                   help="sliding-window attention: each query sees itself and the W-1 tokens before it "
                        "(Hugging Face's sliding_window=W, Megatron-core's window_size=(W-1, 0))")
    p.add_argument("--window-attn-skip-freq", type=window_pattern, default=None,
                   help="with --window-size: K makes every K-th layer full attention; or a list of 0/1 "
                        "per layer, e.g. [1,0,1,0] (1: the window), as Megatron-core's window_attn_skip_freq")
    p.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"], default="vanilla",
                   help="attention sinks: off-by-one adds a zero logit to every softmax, learnable a "
                        "trained logit per head (Megatron-core's softmax_type)")
    p.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention (DeepSeek-V2/V3's MLA; --arch deepseek has it)")
    p.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA: the rank of the query's latent (default: the query projected in one step)")
    p.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: the rank of the key/value latent")
    p.add_argument("--qk-head-dim", type=int, default=None,
                   help="MLA: a query/key head's channels without rotation (default: --hidden / --heads)")
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=None,
                   help="MLA: a query/key head's rotated channels, the key's shared by its heads (default: "
                        "half of --hidden / --heads)")
    p.add_argument("--v-head-dim", type=int, default=None,
                   help="MLA: a value head's channels (default: --hidden / --heads)")
    p.add_argument("--rope-type", choices=["rope", "yarn"], default="rope",
                   help="MLA's rotary embedding: rope, or YaRN stretched --rotary-scaling-factor times")
    p.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="MLA with --rope-type yarn")
    p.add_argument("--mscale", type=float, default=1.0, help="MLA with --rope-type yarn: YaRN's mscale")
    p.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="MLA with --rope-type yarn: YaRN's mscale_all_dim (also scales the softmax)")
    p.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction: this many depths after the decoder, depth k predicting the "
                        "token k + 1 ahead (its loss logged as mtp_k loss)")
    p.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the multi-token prediction losses' mean over the depths joins the backward times "
                        "this")
    p.add_argument(
        "--vocab-size", type=int, default=None,
        help=">= 256 (bytes; the default) or the tokenizer's vocabulary; padded rows are never targets"
    )
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: one GPU per process over NCCL; cpu: gloo; auto: cuda when a GPU is present")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "zb-h1", "zb-v"], default="1f1b",
                   help="zb-h1 / zb-v: the zero-bubble schedules (backward split into input and "
                        "weight halves); zb-v runs two model chunks per rank in a V")
    p.add_argument("--virtual-pipeline", type=int, default=None,
                   help="model chunks per pipeline stage: the interleaved 1F1B schedule (needs --pp >= 2)")
    p.add_argument(
        "--no-bias-gelu-fusion", action="store_true", help="bias + GeLU as two torch ops, not one kernel"
    )
    p.add_argument("--no-bias-dropout-fusion", action="store_true",
                   help="bias + dropout + residual add as torch ops, not one kernel")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each layer's activations in backward (the same as --recompute-granularity "
                        "full --recompute-method uniform --recompute-num-layers 1)")
    p.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute whole layers (see --recompute-method); selective: recompute the "
                        "modules of --recompute-modules inside each layer")
    p.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with full recomputation: uniform checkpoints chunks of --recompute-num-layers "
                        "layers; block checkpoints the first --recompute-num-layers layers of each stage")
    p.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputed chunk (uniform) or recomputed layers per stage (block)")
    p.add_argument("--recompute-modules", nargs="+", default=None,
                   help="with selective recomputation: any of core_attn, mlp, layernorm and, in MoE layers, "
                        "moe, moe_act (needs --moe-grouped-gemm), shared_experts (default core_attn)")
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
    p.add_argument("--tokenizer", default=None,
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
    p.add_argument("--num-experts", type=int, default=None,
                   help="mixture of experts: this many experts in every layer's MLP (default: dense MLPs)")
    p.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (the experts split over it)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert-tensor-parallel size (each expert's MLP split over it; default: --tp)")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="the experts as GroupedMLP (one grouped GEMM per projection)")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="coefficient of the load-balancing loss (0: none); the loss is logged with the loss")
    p.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"],
                   default=None,
                   help="the balance loss --moe-aux-loss-coeff weighs: over the micro-batch's tokens "
                   "(aux_loss, the default) or per sequence (seq_aux_loss)")
    p.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="coefficient of the router's z-loss (default: none)")
    p.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default=None,
                   help="the router's expert scores (default: softmax, or the --load-hf model's)")
    p.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias added to the routing scores, moved "
                   "after each step towards the mean load (needs --moe-router-score-function sigmoid)")
    p.add_argument("--moe-router-bias-update-rate", type=float, default=None,
                   help="with --moe-router-enable-expert-bias: the bias's step per update (default 1e-3)")
    p.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather",
                   help="how tokens reach their experts' ranks")
    p.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's MLP width (default: the dense MLP's)")
    p.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop an expert's tokens beyond capacity factor x tokens x topk / experts "
                   "(default: none dropped)")
    p.add_argument("--moe-layer-freq", default="1",
                   help="which layers are MoE layers: every N-th (an int), or a python list expression of "
                   "0/1 per layer, e.g. \"([0]*1+[1]*3)\": one dense layer, then three MoE layers")
    p.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: the experts in this many groups (consecutive experts; "
                   "with --moe-router-group-topk)")
    p.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="group-limited routing: each token's experts come from its this many best groups")
    p.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiplies the routing weights (default: none)")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert of this width beside the routed ones in every MoE layer")
    p.add_argument("--quick-geglu", action="store_true",
                   help="gated MLPs with quick GELU, x sigmoid(1.702 x), as gpt-oss's experts (instead of "
                   "the arch's activation)")
    p.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="gated MLPs: act(gate) x (up + this offset); gpt-oss: 1")
    p.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="gated MLPs: the gate clamped to at most this, the linear half to within it; "
                   "gpt-oss: 7")
    p.add_argument("--add-bias-linear", action="store_true",
                   help="biases in every linear layer (attention, MLPs, the router, the experts) with "
                   "--arch llama, as gpt-oss; --arch gpt has them")
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
    p.set_defaults(hf_config=None)  # --load-hf's config.json, read by check_args
    p.add_argument("--no-load-optim", action="store_true", help="with --load, keep the fresh optimizer state")
    return p.parse_args(argv)


def moe_freq_type(value: str | int | list[int]) -> int | list[int]:
    """``--moe-layer-freq`` as Megatron-LM reads it: an int, or a python list expression made of
    digits, commas, brackets, parentheses, + and * only."""
    if not isinstance(value, str):
        return value
    if "[" not in value:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"--moe-layer-freq {value!r} is not an int or a list expression") from None
    if re.search(r"[^,\d\[\]()+*]", value):
        raise ValueError(f"--moe-layer-freq {value!r} may hold only digits , [ ] ( ) + *")
    try:
        pattern = eval(value, {"__builtins__": {}})  # noqa: S307  (only the characters above)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--moe-layer-freq {value!r} does not evaluate: {e}") from None
    if not isinstance(pattern, list):
        raise ValueError(f"--moe-layer-freq {value!r} is not a list")
    return pattern


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Every rank runs this on the same arguments, so every rank raises the same error."""
    check_numbers(args)
    args.hf_config = read_hf_config(args.load_hf) if args.load_hf is not None else None
    if args.export_hf is not None and args.arch not in ("llama", "deepseek") and args.load_hf is None:
        raise ValueError("--export-hf writes Llama- or DeepSeek-shaped models: use --arch llama, --arch "
                         "deepseek or --load-hf")
    check_export_dir(args)
    if args.save is not None:
        check_writable_dir("--save", args.save)
    for flag, file in (("--log-json", args.log_json), ("--plot", args.plot)):
        if file:
            check_writable_file(flag, file)
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
    if args.heads % args.tp != 0:
        raise ValueError(f"--heads {args.heads} is not divisible by --tp {args.tp}")
    if args.hidden % args.heads != 0 and args.hf_config is None:
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
    if args.arch == "llama" and args.ffn_hidden is None and llama_ffn_hidden(args.hidden) % args.tp != 0:
        raise ValueError(f"the MLP width {llama_ffn_hidden(args.hidden)} is not divisible by --tp {args.tp}; "
                         "set --ffn-hidden")
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
    if args.data_path is not None:
        if tokenizer_dir(args) is None:
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
        if args.data_path is None and args.sft is None:
            raise ValueError("--eval-interval needs --data-path or --sft (its validation split)")
        if args.eval_interval < 1 or args.eval_iters < 1:
            raise ValueError(f"--eval-interval {args.eval_interval} and --eval-iters {args.eval_iters} "
                             "must be >= 1")
        if gpt_data.split_share(args.split, "valid") == 0:
            raise ValueError(f"--eval-interval needs a validation share in --split {args.split!r}")
    directory = tokenizer_dir(args)
    tokens = gpt_data.HuggingFaceTokenizer(directory).vocab_size if directory is not None else None
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


def check_moe_args(args: argparse.Namespace, world_size: int) -> None:
    """The mixture-of-experts flags: experts divisible by --ep, top-k within the experts, the expert
    grid (--etp x --ep x --pp) dividing the world, sequence parallelism with --tp > 1."""
    args.moe_layer_freq = moe_freq_type(args.moe_layer_freq)
    experts = args.num_experts
    if experts is None:
        for flag, value, default in (("--ep", args.ep, 1), ("--etp", args.etp, None),
                                     ("--moe-grouped-gemm", args.moe_grouped_gemm, False),
                                     ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, 0.0),
                                     ("--moe-z-loss-coeff", args.moe_z_loss_coeff, None),
                                     ("--moe-router-load-balancing-type",
                                      args.moe_router_load_balancing_type, None),
                                     ("--moe-router-score-function", args.moe_router_score_function, None),
                                     ("--moe-router-enable-expert-bias",
                                      args.moe_router_enable_expert_bias, False),
                                     ("--moe-router-bias-update-rate",
                                      args.moe_router_bias_update_rate, None),
                                     ("--moe-expert-capacity-factor", args.moe_expert_capacity_factor, None),
                                     ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size, None),
                                     ("--moe-layer-freq", args.moe_layer_freq, 1),
                                     ("--moe-router-num-groups", args.moe_router_num_groups, None),
                                     ("--moe-router-group-topk", args.moe_router_group_topk, None),
                                     ("--moe-router-topk-scaling-factor",
                                      args.moe_router_topk_scaling_factor, None),
                                     ("--moe-shared-expert-intermediate-size",
                                      args.moe_shared_expert_intermediate_size, None)):
            if value != default:
                raise ValueError(f"{flag} {value} needs --num-experts (a mixture-of-experts model)")
        return
    if experts < 1:
        raise ValueError(f"--num-experts must be >= 1, got {experts}")
    if not 1 <= args.moe_router_topk <= experts:
        raise ValueError(
            f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {experts}"
        )
    if args.ep < 1 or experts % args.ep != 0:
        raise ValueError(f"--num-experts {experts} is not divisible by --ep {args.ep}")
    etp = args.tp if args.etp is None else args.etp
    if etp < 1:
        raise ValueError(f"--etp must be >= 1, got {etp}")
    grid = etp * args.ep * args.pp
    if world_size % grid != 0:
        raise ValueError(
            f"--etp x --ep x --pp = {etp} x {args.ep} x {args.pp} = {grid} does not divide the world size "
            f"{world_size}: the experts' grid must tile the ranks"
        )
    if args.tp > 1 and not args.sequence_parallel:
        raise ValueError(
            "a mixture-of-experts model with --tp > 1 needs --sequence-parallel (as in Megatron-core)"
        )
    check_moe_layer_args(args)
    if not 0.0 <= args.moe_aux_loss_coeff < FLOAT32_MAX:
        raise ValueError(f"--moe-aux-loss-coeff must be a finite number >= 0, got {args.moe_aux_loss_coeff}")
    z_loss = args.moe_z_loss_coeff
    if z_loss is not None and not 0.0 <= z_loss < FLOAT32_MAX:
        raise ValueError(f"--moe-z-loss-coeff must be a finite number >= 0, got {z_loss}")
    sigmoid = args.moe_router_score_function == "sigmoid"
    if args.moe_router_enable_expert_bias and args.load_hf is None and not sigmoid:
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    rate = args.moe_router_bias_update_rate
    if rate is not None and not 0.0 <= rate < FLOAT32_MAX:
        raise ValueError(f"--moe-router-bias-update-rate must be a finite number >= 0, got {rate}")
    factor = args.moe_expert_capacity_factor
    if factor is not None and not 0.0 < factor < FLOAT32_MAX:
        raise ValueError(f"--moe-expert-capacity-factor must be a finite number > 0, got {factor}")
    ffn = args.moe_ffn_hidden_size
    if ffn is not None and (ffn < 1 or ffn % etp != 0):
        raise ValueError(
            f"--moe-ffn-hidden-size {ffn} must be >= 1 and divisible by the expert-tensor size {etp}"
        )


# The TransformerConfig fields of the group-limited routing flags, as the flags name them.
GROUP_FLAGS = {"moe_router_num_groups": "--moe-router-num-groups",
               "moe_router_group_topk": "--moe-router-group-topk", "moe_router_topk": "--moe-router-topk",
               "num_moe_experts": "--num-experts"}


def check_moe_layer_args(args: argparse.Namespace) -> None:
    """Which layers are MoE layers, group-limited routing, the scaling factor, the shared expert."""
    freq, layers = args.moe_layer_freq, args.layers
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"--moe-layer-freq must be >= 1 or a list of 0/1, got {freq}")
    if isinstance(freq, list) and (len(freq) != layers or set(freq) - {0, 1} or 1 not in freq):
        raise ValueError(
            f"--moe-layer-freq {freq} must list a 0 (dense) or 1 (MoE) for each of the --layers {layers} "
            "layers, with at least one 1"
        )
    try:
        check_group_limited_routing(args.num_experts, args.moe_router_topk, args.moe_router_num_groups,
                                    args.moe_router_group_topk)
    except ValueError as e:
        message = str(e)
        for field, flag in GROUP_FLAGS.items():
            message = message.replace(field, flag)
        raise ValueError(message) from None
    factor = args.moe_router_topk_scaling_factor
    if factor is not None and not 0.0 < factor < FLOAT32_MAX:
        raise ValueError(f"--moe-router-topk-scaling-factor must be a finite number > 0, got {factor}")
    shared = args.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % args.tp != 0):
        raise ValueError(
            f"--moe-shared-expert-intermediate-size {shared} must be >= 1 and divisible by --tp {args.tp}"
        )


def check_gated_unit_args(args: argparse.Namespace) -> None:
    """gpt-oss's MLP flags: a gated MLP (--arch llama or --quick-geglu), a finite offset, a positive
    finite clamp; not with --load-hf, whose config.json defines the model."""
    flags = [flag for flag, on in (("--quick-geglu", args.quick_geglu),
                                   ("--add-bias-linear", args.add_bias_linear),
                                   ("--glu-linear-offset", args.glu_linear_offset != 0.0),
                                   ("--activation-func-clamp-value",
                                    args.activation_func_clamp_value is not None))
             if on]
    if flags and args.load_hf is not None:
        raise ValueError(
            f"{' '.join(flags)} cannot be combined with --load-hf: its config.json defines the model"
        )
    if not math.isfinite(args.glu_linear_offset):
        raise ValueError(f"--glu-linear-offset must be a finite number, got {args.glu_linear_offset}")
    clamp = args.activation_func_clamp_value
    if clamp is not None and not 0.0 < clamp < FLOAT32_MAX:
        raise ValueError(f"--activation-func-clamp-value must be a finite number > 0, got {clamp}")
    gated = args.arch == "llama" or args.quick_geglu
    if not gated and (args.glu_linear_offset != 0.0 or clamp is not None):
        raise ValueError("--glu-linear-offset and --activation-func-clamp-value shape a gated MLP: use "
                         "--arch llama or --quick-geglu")


def moe_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of the mixture-of-experts flags (none without --num-experts)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        # The settings that a --load-hf model may have its own of (its dense layers, its shared
        # expert, its router's): only when given.
        **{field: value for field, value in (
            ("moe_layer_freq", None if args.moe_layer_freq == 1 else args.moe_layer_freq),
            ("moe_shared_expert_intermediate_size", args.moe_shared_expert_intermediate_size),
            ("moe_router_load_balancing_type", args.moe_router_load_balancing_type),
            ("moe_router_score_function", args.moe_router_score_function),
            ("moe_router_enable_expert_bias", args.moe_router_enable_expert_bias or None),
            ("moe_router_bias_update_rate", args.moe_router_bias_update_rate),
            ("moe_router_num_groups", args.moe_router_num_groups),
            ("moe_router_group_topk", args.moe_router_group_topk),
            ("moe_router_topk_scaling_factor", args.moe_router_topk_scaling_factor),
        ) if value is not None},
    )


def check_mla_args(args: argparse.Namespace) -> None:
    """Multi-latent attention's ranks and head dims, and what multi-token prediction needs."""
    if args.arch == "deepseek":
        args.multi_latent_attention = True
    head = args.hidden // args.heads
    mla_flags = (("--q-lora-rank", args.q_lora_rank, None), ("--qk-head-dim", args.qk_head_dim, None),
                 ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim, None),
                 ("--v-head-dim", args.v_head_dim, None))
    if not args.multi_latent_attention:
        for flag, value, default in mla_flags:
            if value != default:
                raise ValueError(f"{flag} {value} needs --multi-latent-attention (or --arch deepseek)")
    elif args.hf_config is None:
        if args.num_query_groups not in (None, args.heads):
            raise ValueError(f"--num-query-groups {args.num_query_groups} with multi-latent attention: every "
                             "query head has its own key and value")
        args.qk_head_dim = args.qk_head_dim or head
        args.v_head_dim = args.v_head_dim or head
        args.qk_pos_emb_head_dim = args.qk_pos_emb_head_dim or max(2, head // 2 // 2 * 2)
        for flag, value in (("--q-lora-rank", args.q_lora_rank), ("--kv-lora-rank", args.kv_lora_rank),
                            ("--qk-head-dim", args.qk_head_dim), ("--v-head-dim", args.v_head_dim),
                            ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if args.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even: the rotary "
                             "embedding turns channel pairs")
        for flag, value in (("--rotary-scaling-factor", args.rotary_scaling_factor),
                            ("--mscale", args.mscale), ("--mscale-all-dim", args.mscale_all_dim)):
            if not 0.0 <= value < FLOAT32_MAX:
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
    depths = args.mtp_num_layers
    if depths is not None:
        if depths < 1:
            raise ValueError(f"--mtp-num-layers must be >= 1, got {depths}")
        if not 0.0 <= args.mtp_loss_scaling_factor < FLOAT32_MAX:
            raise ValueError(f"--mtp-loss-scaling-factor must be a finite number >= 0, got "
                             f"{args.mtp_loss_scaling_factor}")
        if args.arch == "gpt" and args.pp > 1:
            raise ValueError(f"--mtp-num-layers with --arch gpt (learned positions) and --pp {args.pp}: the "
                             "last stage would need its own copy of the position embedding; use --arch llama "
                             "or deepseek")


def hf_mtp_layers(num_layers: int, names: list[str]) -> int | None:
    """The multi-token prediction layers a DeepSeek-V3 checkpoint holds (after its decoder layers)."""
    depth = 0
    while f"model.layers.{num_layers + depth}.eh_proj.weight" in names:
        depth += 1
    return depth or None


def apply_deepseek_defaults(args: argparse.Namespace) -> None:
    """--arch deepseek's experts where the flags keep their defaults (DeepSeek-V3's): sigmoid scores
    with the expert bias, the first layer dense (--moe-layer-freq 1 means this), one shared expert as
    wide as a routed one."""
    if args.arch != "deepseek" or args.num_experts is None:
        return
    if args.moe_router_score_function is None:
        args.moe_router_score_function = "sigmoid"
    if args.moe_router_score_function == "sigmoid":
        args.moe_router_enable_expert_bias = True
    if str(args.moe_layer_freq) == "1" and args.layers > 1:
        args.moe_layer_freq = [0] + [1] * (args.layers - 1)
    if args.moe_shared_expert_intermediate_size is None:
        width = args.moe_ffn_hidden_size or args.ffn_hidden or llama_ffn_hidden(args.hidden)
        args.moe_shared_expert_intermediate_size = width


def mla_settings(args: argparse.Namespace) -> dict:
    """The MLATransformerConfig fields of the multi-latent attention flags (none without them)."""
    if not args.multi_latent_attention or args.hf_config is not None:
        return {}
    return dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, qk_layernorm=True,
                rope_type=args.rope_type, rotary_scaling_factor=args.rotary_scaling_factor,
                mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)


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


# The float flags: each finite (and in float32's range, where the optimizer takes it as a float32
# scalar) and within its bounds. NaN passes no comparison, so every check is written as what holds.
FLOAT32_MAX = torch.finfo(torch.float32).max
# Adam's first step moves the weights by --lr / (1 - beta1), a float32 scalar: at most FLOAT32_MAX.
LR_MAX = FLOAT32_MAX * (1 - OptimizerConfig.adam_beta1)


def check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low, high, closed in (
        ("--lr", args.lr, 0.0, LR_MAX, True),
        ("--clip-grad", args.clip_grad, 0.0, FLOAT32_MAX, True),
        ("--weight-decay", args.weight_decay, 0.0, FLOAT32_MAX, True),
        ("--dropout", args.dropout, 0.0, 1.0, False),
    ):
        if not (low <= value <= high and (closed or value < high)):
            bounds = f"[{low:g}, {high:g}" + ("]" if closed else ")")
            raise ValueError(f"{flag} must be a finite number in {bounds}, got {value}")
    if args.timeout is not None and not 0 < args.timeout < 1e9:
        raise ValueError(f"--timeout must be a positive finite number of seconds, got {args.timeout}")


# What a Hugging Face model directory holds; --export-hf-overwrite removes these first.
HF_MODEL_FILES = ("config.json", "model.safetensors.index.json")
# A Hugging Face tokenizer's files (what save_pretrained writes, fast and slow): --export-hf copies
# those of the run's tokenizer beside the weights.
HF_TOKENIZER_FILES = (*gpt_data.TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                      "vocab.txt", "chat_template.jinja", "chat_template.json")


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
    if args.dropout > 0:
        raise ValueError(f"--dropout {args.dropout} with --cp {args.cp}: attention dropout is not supported "
                         "with context parallelism")


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


def device_of(args: argparse.Namespace) -> torch.device:
    """Where this rank's model and batches live: its GPU when the process group runs on NCCL."""
    backend = dist.get_backend()
    if args.device == "cuda" and backend != "nccl":
        raise ValueError(f"--device cuda needs an NCCL process group, this one runs on {backend}")
    if args.device == "cpu" and backend == "nccl":
        raise ValueError("--device cpu needs a gloo process group, this one runs on nccl")
    return comm_device(dist.group.WORLD)


def load_corpus(path: str | None, min_bytes: int, tokenizer: str | None = None) -> torch.Tensor:
    """The training text as byte ids, or as the token ids of ``tokenizer`` (a directory). Default:
    the standard library's top-level sources, in name order, which every machine with this Python
    has."""
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
    else:
        chunks, size = [], 0
        for name in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            with open(name, "rb") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
            if size >= DEFAULT_CORPUS_BYTES:
                break
        data = b"".join(chunks)[:DEFAULT_CORPUS_BYTES]
    if tokenizer is not None:
        ids = gpt_data.HuggingFaceTokenizer(tokenizer).tokenize(data.decode("utf-8", errors="replace"))
        if len(ids) < min_bytes:
            raise ValueError(
                f"the corpus has {len(ids)} tokens; at least {min_bytes} are needed (--seq-len + 2)")
        return torch.tensor(ids, dtype=torch.long)
    if len(data) < min_bytes:
        raise ValueError(f"the corpus has {len(data)} bytes; at least {min_bytes} are needed (--seq-len + 2)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def step_microbatches(corpus: torch.Tensor, step: int, args: argparse.Namespace,
                      device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch of ``step``.

    The global batch is the same set of samples in every layout: its sample offsets depend only
    on the seed and the step; data-parallel rank d takes the d-th contiguous share of it.
    """
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    offsets = torch.randint(0, corpus.numel() - args.seq_len - 1, (args.global_batch_size,), generator=g)
    per_rank = args.global_batch_size // args.dp
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = offsets[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    window = torch.arange(args.seq_len + 1)
    samples = corpus[mine[:, None] + window].to(device)  # [per_rank, s + 1]
    return [
        {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
        for mb in samples.split(args.micro_batch_size)
    ]


def loss_func(loss_mask: torch.Tensor | None,
              output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean over the micro-batch's tokens (those of ``loss_mask``, where given). With context
    parallelism each rank holds part of each sequence: its sum over the token count summed over the cp
    ranks (the schedule multiplies by cp and DDP averages over dp x cp), and the reported loss is the
    sum over cp."""
    output = output.float() if output.dtype != torch.float64 else output
    cp_group = parallel_state.get_context_parallel_group()
    if loss_mask is not None:
        output = output * loss_mask.to(output.dtype)
    count = torch.tensor(output.numel() if loss_mask is None else loss_mask.sum().item(), dtype=output.dtype)
    if cp_group.size() == 1:
        loss = output.mean() if loss_mask is None else output.sum() / count.clamp(min=1)
        return loss, {"lm loss": loss.detach()}
    totals = torch.stack([output.detach().sum(), count.to(output.device)])
    with reported("all-reduce of the loss over the context-parallel group", cp_group):
        dist.all_reduce(totals, group=cp_group)
    return output.sum() / totals[1], {"lm loss": totals[0] / totals[1]}


def token_sum_loss_func(loss_mask: torch.Tensor,
                        output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss summed over the micro-batch's tokens of ``loss_mask`` and their count, Megatron-LM's
    three values under ``calculate_per_token_loss``: the schedule sums them over the micro-batches,
    finalize_model_grads divides the gradients by the count summed over the data- and
    context-parallel ranks, so the step's loss is the mean over every masked-in token of the global
    batch, however they lie in rows, micro-batches and ranks. Reported: the [sum, count] pair."""
    output = output.float() if output.dtype != torch.float64 else output
    total = (output * loss_mask.to(output.dtype)).sum()
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.to(total.dtype)])}


def forward_step(data_iterator, model: DistributedDataParallel):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        return model(None, None), loss_func
    tokens = batch["tokens"]
    packed_seq_params = None
    if "cu_seqlens" in batch:  # one packed row: the thd format, each sequence split over cp on its own
        batch = dict(batch)
        cu_seqlens = batch.pop("cu_seqlens").reshape(-1)
        # The rows' boundaries are the layout, each sequence padded to a multiple of 2 x cp.
        batch, packed_seq_params = get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens,
                                                                 batch.pop("max_seqlen").reshape(-1))
    else:
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        batch = get_batch_on_this_cp_rank({"position_ids": positions, **batch})
    loss_mask = batch.get("loss_mask")
    # --sft rows mark their padding: the MoE routers leave it out of their losses and counts
    # (Megatron-LM's training loop passes no padding_mask, so its routers count the padding).
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                   packed_seq_params=packed_seq_params, loss_mask=loss_mask,
                   padding_mask=batch.get("padding_mask"))
    if getattr(model, "module", model).config.calculate_per_token_loss:
        return output, functools.partial(token_sum_loss_func, loss_mask)
    return output, functools.partial(loss_func, loss_mask)


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else DTYPES[args.dtype]


def llama_ffn_hidden(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 32."""
    return -(-8 * hidden // 3 // 32) * 32


def recompute_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig recomputation fields of the flags; ``--recompute`` is full
    recomputation of each layer on its own."""
    if args.recompute:
        if args.recompute_granularity not in (None, "full"):
            raise ValueError(f"--recompute is full recomputation; it cannot be combined with "
                             f"--recompute-granularity {args.recompute_granularity}")
        return dict(recompute_granularity="full", recompute_method=args.recompute_method or "uniform",
                    recompute_num_layers=args.recompute_num_layers or 1,
                    recompute_modules=args.recompute_modules)
    return dict(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, recompute_modules=args.recompute_modules)


def build_model(args: argparse.Namespace, device: torch.device | str = "cpu") -> list[GPTModel]:
    """This rank's model chunks: one GPTModel, or one per virtual pipeline stage."""
    dtype = params_dtype(args)
    training = dict(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        cp_comm_type=args.cp_comm_type,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=True,
        **recompute_settings(args),
        bias_activation_fusion=not args.no_bias_gelu_fusion,
        bias_dropout_fusion=not args.no_bias_dropout_fusion,
        sequence_parallel=args.sequence_parallel,
        finalize_model_grads_func=finalize_model_grads,
        # packed rows: the loss per token of the global batch (Megatron-LM's --calculate-per-token-loss)
        calculate_per_token_loss=args.sft is not None,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline,
        **moe_settings(args),
    )
    if args.hf_config is None:  # a --load-hf model's attention is its own
        training.update(
            window_size=None if args.window_size is None else (args.window_size - 1, 0),
            window_attn_skip_freq=args.window_attn_skip_freq,
            softmax_type=args.softmax_type,
        )
    if args.mtp_num_layers is not None:
        training.update(mtp_num_layers=args.mtp_num_layers,
                        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if args.hf_config is not None:
        config, model_kwargs = config_from_hf(args.hf_config, **training)
    else:
        llama = args.arch in ("llama", "deepseek")
        activation = torch.nn.functional.silu if llama else torch.nn.functional.gelu
        config = (MLATransformerConfig if args.multi_latent_attention else TransformerConfig)(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            num_query_groups=args.num_query_groups,
            ffn_hidden_size=args.ffn_hidden or (llama_ffn_hidden(args.hidden) if llama else None),
            normalization="RMSNorm" if llama else "LayerNorm",
            # DeepSeek's value, the one its Hugging Face models normalise the latents with
            layernorm_epsilon=1e-6 if args.arch == "deepseek" else 1e-5,
            gated_linear_unit=llama or args.quick_geglu,
            activation_func=quick_gelu if args.quick_geglu else activation,
            glu_linear_offset=args.glu_linear_offset,
            activation_func_clamp_value=args.activation_func_clamp_value,
            add_bias_linear=not llama or args.add_bias_linear,
            **mla_settings(args),
            **training,
        )
        # --vocab-size left unset and check_args not run (a script building the model alone): bytes
        vocab_size = BYTE_VOCAB if args.vocab_size is None else args.vocab_size
        model_kwargs = dict(vocab_size=vocab_size, max_sequence_length=args.seq_len,
                            share_embeddings_and_output_weights=not llama,
                            position_embedding_type="rope" if llama else "learned_absolute")
    torch.manual_seed(args.seed)  # the CPU generator: dropout outside tensor-parallel regions on CPU
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    stages = [None] if args.virtual_pipeline is None else range(args.virtual_pipeline)
    models = [GPTModel(config, init_seed=args.seed, vp_stage=vp_stage, **model_kwargs) for vp_stage in stages]
    if args.load_hf is not None:
        load_hf_state_dict(models, args.load_hf)
    return [model.to(device) for model in models]


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


def train(args: argparse.Namespace) -> dict:
    """Runs the training loop in an initialised process group; returns the log (every rank)."""
    world_size = dist.get_world_size()
    check_args(args, world_size)
    corpus = None
    if args.data_path is None and args.sft is None:  # datasets are built once the groups exist
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
        if args.data_path is not None:
            sizes = gpt_data.split_sizes(args.steps, args.global_batch_size, args.eval_interval,
                                         args.eval_iters)
            tokenizer = gpt_data.HuggingFaceTokenizer(tokenizer_dir(args))
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
        return _train_loop(args, corpus)
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
             num_microbatches: int, needs_data: list[bool], device: torch.device) -> tuple[float, float]:
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
                forward_step_func=forward_step, data_iterator=iterators[0] if len(chunks) == 1 else iterators,
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


def _train_loop(args: argparse.Namespace, corpus: torch.Tensor | list) -> dict:
    device = device_of(args)
    # Gradients accumulate in float32 main_grad buffers (16-bit runs) and are averaged over the
    # data-parallel group (reduce-scattered for the distributed optimizer) in buckets that start
    # during the last micro-batch's backward; the earlier micro-batches only accumulate (no_sync).
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
    )
    chunks = [
        DistributedDataParallel(
            chunk,
            data_parallel_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            bucket_size_bytes=args.grad_bucket_bytes,
            ddp_config=ddp_config,
        )
        for chunk in build_model(args, device)
    ]
    # One chunk: a plain model, as before; several: the list the interleaved schedule takes.
    model = chunks[0] if len(chunks) == 1 else chunks
    config = chunks[0].module.config
    config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            lr=args.lr,
            weight_decay=args.weight_decay,
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
    start_step = resume(args, model, optimizer)
    log_event(args, event="start", attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
              resumed_from=start_step, config=run_config(args))
    if args.virtual_pipeline is not None and args.schedule == "1f1b":
        forward_backward = get_forward_backward_func()  # interleaved 1F1B
    else:
        forward_backward = get_forward_backward_func(schedule=args.schedule)
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.dp)
    # Only the chunk that embeds and the one that computes the loss read the batch; with packed
    # rows every chunk reads it, for the sequence boundaries its attention needs.
    needs_data = [args.sft is not None or c.module.pre_process or c.module.post_process for c in chunks]
    rank0 = dist.get_rank() == 0
    progress = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True)

    losses, tokens_per_s, grad_norms, skipped, aux_losses, mtp, val_losses = [], [], [], 0, [], [], []
    loss_tokens = []  # --sft: the response tokens of each step's global batch
    datasets = corpus if args.data_path is not None or args.sft is not None else None
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
            forward_step_func=forward_step,
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
        if nonfinite:
            update_successful, grad_norm = False, None
            if rank0:
                print(f"step {step + 1}: {nonfinite}; the step is skipped", file=sys.stderr, flush=True)
        else:
            update_successful, grad_norm, _ = optimizer.step()
        skipped += not update_successful
        grad_norms.append(grad_norm)
        losses.append(total / weight if weight > 0 else 0.0)
        if args.sft is not None:
            loss_tokens.append(int(weight))
        aux_losses.append(moe_aux_losses(args, num_microbatches, config))
        mtp.append(mtp_losses(args, num_microbatches, device))
        tokens_per_s.append(tokens_per_step / (time.perf_counter() - start))
        # the norm before clipping; none for a skipped step
        log_event(args, step=step + 1, loss=losses[-1], tokens_per_s=tokens_per_s[-1],
                  grad_norm=grad_norm, skipped=not update_successful,
                  **({"loss_tokens": loss_tokens[-1]} if args.sft is not None else {}),
                  **aux_losses[-1], **mtp[-1])
        if args.eval_interval is not None and (step + 1) % args.eval_interval == 0:
            val, val_weight = evaluate(args, (step + 1) // args.eval_interval - 1, datasets[1], model, chunks,
                                       forward_backward, num_microbatches, needs_data, device)
            val_losses.append((step + 1, val))
            log_event(args, event="eval", step=step + 1, val_loss=val, val_ppl=math.exp(min(val, 700.0)),
                      **({"loss_tokens": int(val_weight)} if args.sft is not None else {}))
        if progress is not None:
            aux = {name: f"{value:.4f}" for name, value in {**aux_losses[-1], **mtp[-1]}.items()}
            if val_losses:
                val = val_losses[-1][1]
                aux.update(val_loss=f"{val:.4f}", val_ppl=f"{math.exp(min(val, 700.0)):.1f}")
            progress.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s[-1]:.0f}", **aux)
            progress.update(1)
        at_interval = args.save_interval is not None and (step + 1) % args.save_interval == 0
        if args.save and (at_interval or step + 1 == args.steps):
            log_event(args, event="save", iteration=step + 1, path=save(args, step + 1, model, optimizer))
    if progress is not None:
        progress.close()
    if args.export_hf is not None:
        log_event(args, event="export_hf", path=export_hf(args, [c.module for c in chunks]))
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


def export_hf(args: argparse.Namespace, models: list[GPTModel]) -> str:
    """Writes the trained weights as Hugging Face safetensors and config.json, and the files of the
    run's tokenizer (--tokenizer, or --load-hf's) where it has one (rank 0 writes, every rank
    gathers); returns the directory."""
    state = export_hf_state_dict(models)
    hf_config = args.hf_config or hf_config_dict(models)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        os.makedirs(args.export_hf, exist_ok=True)
        for name in os.listdir(args.export_hf):  # the model being replaced (--export-hf-overwrite)
            if name in HF_MODEL_FILES or name in HF_TOKENIZER_FILES or name.endswith(".safetensors"):
                os.remove(os.path.join(args.export_hf, name))
        tensors = {name: t.contiguous() for name, t in state.items()}
        if hf_config.get("tie_word_embeddings"):
            del tensors["lm_head.weight"]  # the embedding, as save_pretrained stores a tied model
        save_file(tensors, os.path.join(args.export_hf, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(args.export_hf, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        tokenizer = tokenizer_dir(args)
        for name in HF_TOKENIZER_FILES if tokenizer is not None else ():
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(args.export_hf, name))
    dist.barrier()
    return args.export_hf


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


def run_config(args: argparse.Namespace) -> dict:
    config = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    config["world_size"] = dist.get_world_size()
    return config


def log_event(args: argparse.Namespace, **record) -> None:
    """Rank 0 appends one JSON line to --log-json, at once, so a run that dies leaves its steps."""
    if args.log_json and dist.get_rank() == 0:
        with open(args.log_json, "a") as f:
            f.write(json.dumps(strict_json({**record, "time": time.time()}), allow_nan=False) + "\n")


def strict_json(value):
    """``value`` with every NaN or infinite float as None: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def save(
    args: argparse.Namespace, iteration: int, model: torch.nn.Module, optimizer: MegatronOptimizer
) -> str:
    # The data position is the step: step k always reads the same global batch.
    data = {"consumed_samples": iteration * args.global_batch_size,
            "global_batch_size": args.global_batch_size}
    if args.sft is not None:  # what, besides the records, decides the rows
        data["pad_seq_to_mult"] = args.pad_seq_to_mult
    return save_checkpoint(args.save, iteration, model, optimizer, metadata={"data": data, "seed": args.seed},
                           overwrite=args.allow_overwrite, keep_last=args.keep_last)


def resume(args: argparse.Namespace, model: torch.nn.Module, optimizer: MegatronOptimizer) -> int:
    """Loads --load if given; returns the step to continue from."""
    if args.load is None:
        return 0
    if find_checkpoint(args.load) is None:  # allowed by check_checkpoint_paths
        if dist.get_rank() == 0:
            print(f"no checkpoint in {args.load!r} yet; training from scratch", flush=True)
        return 0
    marker = load_checkpoint(
        args.load, model, None if args.no_load_optim else optimizer, load_rng=not args.no_load_rng
    )
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
    if dist.get_rank() == 0:
        print(f"resumed from iteration {marker['iteration']} ({marker['path']})", flush=True)
        if not marker["rng_loaded"] and not args.no_load_rng:
            print(f"note: {marker['path']} was saved at layout {marker['layout']}; RNG states start afresh",
                  file=sys.stderr)
    return marker["iteration"]


def write_outputs(log: dict, args: argparse.Namespace) -> None:
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(log["start_step"] + 1, log["start_step"] + len(log["losses"]) + 1), log["losses"],
                label="train")
        if log.get("val_losses"):
            ax.plot(*zip(*log["val_losses"]), "o-", label="validation")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss (nats / {'byte' if args.tokens is None else 'token'})")
        c = log["config"]
        ax.set_title(
            f"GPT {c['layers']}x{c['hidden']}, tp {c['tp']} pp {c['pp']} dp {c['dp']}, {c['schedule']}"
        )
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        plt.close(fig)


def summary(log: dict, args: argparse.Namespace) -> str:
    # The first step includes warm-up; it is the figure only when it is the only one.
    timed = log["tokens_per_s"][1:] or log["tokens_per_s"]
    return (
        f"loss {log['losses'][0]:.4f} -> {log['losses'][-1]:.4f} over steps "
        f"{log['start_step'] + 1}-{args.steps}, "
        f"{sum(timed) / len(timed):.0f} tokens/s"
        + (f", validation loss {log['val_losses'][-1][1]:.4f} at step {log['val_losses'][-1][0]}"
           if log.get("val_losses") else "")
        + (f"; loss curve: {args.plot}" if args.plot else "")
    )


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's environment, such that a restarted group never reads
    the addresses its killed predecessor left behind.

    torchrun (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) serves one store for all attempts of
    a job, so a restarted rank may read a dead rank's address from it, and its restart count,
    kept per launcher, is no attempt number all nodes share. Instead rank 0 starts a store of its
    own, as torchrun does without sharing, and announces its port in torchrun's store; the others
    take a port that refuses connections for one the previous attempt left and read it again.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ["MASTER_ADDR"]  # torchrun's store runs on global rank 0's node
    shared = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    key = "train_gpt/store_port"
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        shared.set(key, str(store.port))
    else:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            port = int(shared.get(key))
            try:
                store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=2))
                break
            except RuntimeError:  # the previous attempt's rank 0, gone: wait for this one's
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def main(argv: list[str] | None = None) -> dict:
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
        log = train(args)
        if dist.get_rank() == 0 and not log["losses"]:
            print(f"nothing to do: the checkpoint is at step {log['start_step']} of --steps {args.steps}")
        elif dist.get_rank() == 0:
            write_outputs(log, args)
            print(summary(log, args))
        return log
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, CheckpointingException, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except dist.DistBackendError as e:
        # A rank died or stopped answering: the collective, the group and the ranks this one waited
        # for, in one line; under torchrun also in its error file, which its "Root Cause" shows.
        print(f"error: {e}", file=sys.stderr)
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(e)
        sys.exit(1)
