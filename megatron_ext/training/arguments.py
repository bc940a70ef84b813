"""The training program's command line: every flag, its default and its help."""

from __future__ import annotations

import argparse
import ast
import re

import torch

from megatron_ext.distributed.distributed_data_parallel import DEFAULT_BUCKET_SIZE_BYTES


DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


BYTE_VOCAB = 256
DESCRIPTION = """Trains a GPT with tensor x pipeline x context x expert x data parallelism.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2

The number of processes must equal tp x cp x pp x dp (dp is inferred when not given)."""


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
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
