"""The recipes of examples/configs/: each real-size one is the model it names (its parameter count, from
its flags' config, is the published one) at a layout the checks accept on its GPU count; each shrunk
one (``*_tiny.yaml``) trains on 4 CPU processes."""

from __future__ import annotations

import math

import pytest

from megatron_ext.training.arguments import parse_args
from megatron_ext.training.model import core_transformer_config_from_args
from megatron_ext.training.validation import check_args
from tests.conftest import ROOT, load_train_gpt
from tests.distributed import run_distributed

CONFIGS = ROOT / "examples" / "configs"
# recipe: (its GPU count, the parameters of the published model, None where not counted here)
REAL = {
    "llama3_8b": (64, 8_030_261_248),
    "qwen3_8b": (32, 8_190_735_360),
    "qwen3_30b_a3b": (32, 30_532_122_624),
    "mixtral_8x7b": (64, 46_702_792_704),
    "gpt_oss_20b": (32, 20_914_757_184),
    "deepseek_v3": (256, None),  # multi-latent attention: its count is not written out here
}


def parameters(config, kwargs, vocab: int) -> int:
    """A standard-attention model's parameters from its config alone, with a vocabulary of ``vocab``
    (the tokenizer's, before the padding to a multiple of 128 x tp): embedding and output layer, per
    layer the attention (with biases and sinks where it has them), the norms, the dense MLP or the
    router and experts."""
    h, heads = config.hidden_size, config.num_attention_heads
    groups = config.num_query_groups or heads
    c, bias = config.kv_channels, config.add_bias_linear
    total = vocab * h * (1 if kwargs["share_embeddings_and_output_weights"] else 2) + h  # + the final norm
    attention = h * c * (heads + 2 * groups) + c * heads * h + (c * (heads + 2 * groups) + h) * bias
    attention += heads * (config.softmax_type == "learnable") + 2 * c * config.qk_layernorm + 2 * h
    up = 2 if config.gated_linear_unit else 1

    def mlp(width: int) -> int:
        return h * width * up + width * h + (width * up + h) * bias

    for layer in range(config.num_layers):
        if config.num_moe_experts is None:
            total += attention + mlp(config.ffn_hidden_size)
        else:
            experts = config.num_moe_experts
            total += attention + h * experts + experts * bias + experts * mlp(config.moe_ffn_hidden_size)
    return total


def _args(name: str, world: int):
    args = parse_args(["--config", str(CONFIGS / f"{name}.yaml"), "--no-progress", "--plot", ""])
    check_args(args, world)
    return args


def test_real_size_recipes_are_the_published_models():
    for name, (world, count) in REAL.items():
        args = _args(name, world)
        config, kwargs = core_transformer_config_from_args(args)
        assert config.num_layers == args.layers and args.bf16, name
        vocab = args.null_tokenizer_vocab + 1  # the NullTokenizer's ids and its end of document
        assert kwargs["vocab_size"] == -(-vocab // (128 * args.tp)) * 128 * args.tp, name
        if count is not None:
            assert parameters(config, kwargs, vocab) == count, name
    # DeepSeek-V3: its MLA, routing and stack as its config.json has them
    config, _ = core_transformer_config_from_args(_args("deepseek_v3", 256))
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim) == (
        1536, 512, 128, 64)
    assert config.moe_layer_freq == [0] * 3 + [1] * 58 and config.rotary_scaling_factor == 40
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_router_num_groups) == (256, 8, 8)


def _train(names: list[str]) -> dict:
    train_gpt = load_train_gpt()
    out = {}
    for name in names:
        args = parse_args(["--config", str(CONFIGS / f"{name}.yaml"), "--train-iters", "3", "--no-progress",
                           "--plot", ""])
        out[name] = train_gpt.train(args)["losses"]
    return out


@pytest.mark.slow
def test_tiny_recipes_train_on_four_processes():
    names = sorted(path.stem for path in CONFIGS.glob("*_tiny.yaml"))
    assert names == sorted(f"{name}_tiny" for name in REAL)
    losses = run_distributed(4, _train, names, timeout=600)[0]
    for name in names:
        assert len(losses[name]) == 3 and all(math.isfinite(x) for x in losses[name]), name
