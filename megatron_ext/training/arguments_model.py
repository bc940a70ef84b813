"""The model's flags: its shape, attention, multi-latent attention, experts and recomputation,
under Megatron-LM's names where it has them (the short names of the first version kept as aliases)."""

from __future__ import annotations

import argparse
import ast
import re


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


def window_size(text: str) -> int:
    """--window-size: W (the tokens a query sees, itself included), or Megatron-LM's "L,0" / "(L,0)"
    (L tokens before it, none after: W = L + 1)."""
    parts = text.strip().strip("()").split(",")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        return values[0]
    if len(values) == 2 and values[1] == 0:
        return values[0] + 1
    if len(values) == 2:
        raise argparse.ArgumentTypeError(f"{text!r} looks {values[1]} tokens ahead: a causal model's window "
                                         "has none after the query (\"L,0\")")
    raise argparse.ArgumentTypeError(f"expected W or \"L,0\", got {text!r}")


def layer_pattern(value: str | int | list[int], flag: str) -> int | list[int]:
    """A layer-pattern flag as Megatron-LM reads it: an int, or a python list expression made of
    digits, commas, brackets, parentheses, + and * only."""
    if not isinstance(value, str):
        return value
    if "[" not in value:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{flag} {value!r} is not an int or a list expression") from None
    if re.search(r"[^,\d\[\]()+*]", value):
        raise ValueError(f"{flag} {value!r} may hold only digits , [ ] ( ) + *")
    try:
        pattern = eval(value, {"__builtins__": {}})  # noqa: S307  (only the characters above)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{flag} {value!r} does not evaluate: {e}") from None
    if not isinstance(pattern, list):
        raise ValueError(f"{flag} {value!r} is not a list")
    return pattern


def moe_freq_type(value: str | int | list[int]) -> int | list[int]:
    """``--moe-layer-freq`` as Megatron-LM reads it (``layer_pattern``)."""
    return layer_pattern(value, "--moe-layer-freq")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--num-layers", "--layers", dest="layers", type=int, default=4)
    p.add_argument("--hidden-size", "--hidden", dest="hidden", type=int, default=128)
    p.add_argument("--num-attention-heads", "--heads", dest="heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads for grouped-query attention (default: --heads; 1 with "
                        "--group-query-attention, as Megatron-LM)")
    p.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention over --num-query-groups key/value heads (Megatron-LM's "
                        "switch; --num-query-groups alone has the same effect here)")
    p.add_argument(
        "--ffn-hidden-size", "--ffn-hidden", dest="ffn_hidden",
        type=int,
        default=None,
        help="MLP width (default: 8/3 x --hidden rounded up to a multiple of 32 with --arch llama or "
        "deepseek; Megatron-LM's int(8/3 x --hidden / 64) x 64 with --swiglu; else 4 x --hidden)",
    )
    p.add_argument("--seq-length", "--seq-len", dest="seq_len", type=int, default=128)
    p.add_argument("--window-size", type=window_size, default=None,
                   help="sliding-window attention: W, each query seeing itself and the W-1 tokens before "
                        "it (Hugging Face's sliding_window=W), or Megatron-LM's \"L,0\" (Megatron-core's "
                        "window_size=(L, 0): L tokens before it, so W = L + 1)")
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
    p.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="MLA's rotary embedding: rope, or YaRN stretched --rotary-scaling-factor times "
                        "(default: yarn, as Megatron-LM's, which at the default factor 1 is rope)")
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
        help="the model's vocabulary: >= 256 (bytes; the default) or the tokenizer's; padded rows are never "
        "targets. With --tokenizer-type NullTokenizer, as in Megatron-LM, the tokenizer's ids (0 to N - 1, "
        "and N its end of document), the model's vocabulary N + 1 padded to --make-vocab-size-divisible-by "
        "x --tp"
    )
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout (each replaced by its flag below where given)")
    p.add_argument("--hidden-dropout", type=float, default=None, help="dropout after attention and MLP "
                   "(default: --dropout; Megatron-LM's default is 0.1)")
    p.add_argument("--attention-dropout", type=float, default=None, help="dropout of the attention "
                   "probabilities (default: --dropout; Megatron-LM's default is 0.1)")
    p.add_argument(
        "--no-bias-gelu-fusion", action="store_true", help="bias + GeLU as two torch ops, not one kernel"
    )
    p.add_argument("--no-bias-dropout-fusion", action="store_true",
                   help="bias + dropout + residual add as torch ops, not one kernel")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each layer's activations in backward (the same as --recompute-granularity "
                        "full --recompute-method uniform --recompute-num-layers 1)")
    p.add_argument("--recompute-activations", action="store_true",
                   help="selective recomputation of the attention core (Megatron-LM's shorthand for "
                        "--recompute-granularity selective)")
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
    p.add_argument("--num-experts", type=int, default=None,
                   help="mixture of experts: this many experts in every layer's MLP (default: dense MLPs)")
    p.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
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
    p.add_argument("--is-hybrid-model", action="store_true",
                   help="a Mamba-2 hybrid (MambaModel): layers by --hybrid-override-pattern or the ratios")
    p.add_argument("--hybrid-override-pattern", default=None,
                   help="one symbol per layer: M Mamba-2, * attention, - MLP, E mixture of experts "
                   "(implies --is-hybrid-model)")
    p.add_argument("--hybrid-attention-ratio", type=float, default=0.0,
                   help="with --is-hybrid-model and no pattern: the share of attention layers")
    p.add_argument("--hybrid-mlp-ratio", type=float, default=0.0,
                   help="with --is-hybrid-model and no pattern: the share of MLP layers")
    p.add_argument("--mamba-state-dim", type=int, default=128, help="Mamba-2's state size per head")
    p.add_argument("--mamba-head-dim", type=int, default=64, help="Mamba-2's head width")
    p.add_argument("--mamba-num-groups", type=int, default=8, help="Mamba-2's groups of B and C")
    p.add_argument("--mamba-num-heads", type=int, default=None,
                   help="Mamba-2's heads (default: 2 x hidden / head width)")
    p.add_argument("--experimental-attention-variant", choices=["gated_delta_net"], default=None,
                   help="Gated DeltaNet linear attention in the layers --linear-attention-freq names")
    p.add_argument("--linear-attention-freq", default=None,
                   help="with --experimental-attention-variant: every N-th layer full attention (an int), or "
                   "a python list expression of 0/1 per layer (1: linear attention), e.g. \"([1]*3+[0])*2\"")
    p.add_argument("--linear-conv-kernel-dim", type=int, default=4, help="Gated DeltaNet's convolution width")
    p.add_argument("--linear-key-head-dim", type=int, default=128, help="Gated DeltaNet's key head width")
    p.add_argument("--linear-value-head-dim", type=int, default=128, help="Gated DeltaNet's value head width")
    p.add_argument("--linear-num-key-heads", type=int, default=16,
                   help="Gated DeltaNet's query and key heads")
    p.add_argument("--linear-num-value-heads", type=int, default=32,
                   help="Gated DeltaNet's value heads (a multiple of the key heads)")
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
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="positions the model holds, >= --seq-length (the learned position table's rows; "
                        "default: --seq-length)")
    p.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head (default: --hidden / --heads)")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None,
                   help="the norm of every layer (default: --arch's: LayerNorm for gpt, RMSNorm for llama "
                        "and deepseek)")
    p.add_argument("--norm-epsilon", type=float, default=None,
                   help="the norms' epsilon (default 1e-5; 1e-6 with --arch deepseek)")
    p.add_argument("--swiglu", action="store_true",
                   help="gated MLPs with SiLU (--arch llama and deepseek have them)")
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default=None,
                   help="learned positions or rotary embeddings (default: --arch's: learned_absolute for "
                        "gpt, rope for llama and deepseek)")
    p.add_argument("--rotary-base", type=int, default=10000, help="the rotary embedding's base")
    p.add_argument("--rotary-percent", type=float, default=1.0,
                   help="the share of each head's channels the rotary embedding turns")
    p.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the weights' normal initialisation")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own, not the embedding (--arch llama and deepseek have it)")
    p.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers (--arch llama and deepseek have none)")
    p.add_argument("--attention-output-gate", action="store_true",
                   help="scale each attention head's output by sigmoid of a gate projected beside its query "
                   "(Qwen3-Next)")
    p.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each query and key head before attention (Qwen3, OLMo 2)")
    p.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss per token of the global batch, not the mean of the micro-batches' means "
                        "(always so with --sft)")
