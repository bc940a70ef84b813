"""Megatron-LM launch lines run unchanged: those of Megatron-LM core_v0.16.1's own example scripts for
GPT-3 175B (examples/gpt3/train_gpt3_175b_distributed.sh), Llama-3 8B (examples/llama/
train_llama3_8b_h100_fp8.sh, its --mock-data branch), Mixtral 8x7B (examples/mixtral/
train_mixtral_8x7b_distributed.sh) and DeepSeek-V3 (the proxy of tests/functional_tests), shrunk to a
CPU (layers, widths, experts, batch, iterations; 4 processes), their data Megatron-core's mock
documents where the scripts read a corpus, the sample-based schedule flags as iterations, and their
GPU-only flags (fp8, profiling, DeepEP, TransformerEngine's fusions) left out: those are refused by
name. Each line builds the model Megatron-LM builds from it, and trains."""

from __future__ import annotations

import math
import shlex

import pytest
import torch

from megatron_ext.training.arguments import parse_args
from megatron_ext.training.model import core_transformer_config_from_args
from megatron_ext.training.validation import check_args
from tests.conftest import load_train_gpt
from tests.distributed import run_distributed

MOCK = "--mock-data --tokenizer-type NullTokenizer --vocab-size 255"
GPT3 = f"""
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
    --attention-backend auto
    --micro-batch-size 1 --global-batch-size 4 --train-iters 3 --weight-decay 0.1 --adam-beta1 0.9
    --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
    --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430
    {MOCK} --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
"""
LLAMA3 = f"""
    --use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
    --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused
    --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 8 --train-iters 3 --lr-decay-iters 3 --lr-warmup-iters 1
    --lr 0.00015 --min-lr 0.00001 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --cross-entropy-loss-fusion --calculate-per-token-loss
    --tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather
    {MOCK} --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
    --log-interval 1 --eval-iters 2 --eval-interval 2 --save-interval 1000 --log-throughput
    --ckpt-format torch_dist --distributed-timeout-minutes 60
"""
MIXTRAL = f"""
    --use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 64 --num-layers 2
    --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2
    --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
    --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    {MOCK} --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 3 --lr-decay-iters 320
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 2 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
    --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --no-load-optim --no-load-rng
"""
DEEPSEEK = f"""
    --distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --expert-model-parallel-size 2 --context-parallel-size 1 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models
    --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1 --global-batch-size 8
    --train-iters 3 --no-check-for-nan-in-loss-and-grad --cross-entropy-loss-fusion
    --transformer-impl transformer_engine
    --seq-length 32 {MOCK} --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader
    --num-workers 6
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --kv-channels 16
    --max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000
    --make-vocab-size-divisible-by 32 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --untie-embeddings-and-output-weights --multi-latent-attention --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0
    --weight-decay 0.1 --qk-layernorm
    --lr-decay-iters 3 --lr-warmup-iters 1 --lr-warmup-init 1e-7 --lr 1e-5 --min-lr 1e-6
    --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
    --num-experts 4 --moe-layer-freq ([0]*1+[1]*3) --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 1
    --moe-router-num-groups 2 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
    --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --eval-iters 2 --eval-interval 2 --save-interval 5000 --init-method-std 0.02 --log-memory-to-tensorboard
    --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --bf16
"""
LINES = {"gpt3": GPT3, "llama3": LLAMA3, "mixtral": MIXTRAL, "deepseek": DEEPSEEK}
WORLD = 4
# What the scripts hold that megatron_ext does not implement: each refused with one line naming it.
REFUSED = [
    "--rampup-batch-size 16 16 5859375",
    "--apply-layernorm-1p",
    "--fp8-format hybrid",
    "--train-samples 100",
    "--lr-decay-samples 100",
    "--decoupled-lr 5.0e-4",
    "--manual-gc",
    "--moe-permute-fusion",
    "--moe-router-dtype fp32",
    "--profile",
    "--exit-duration-in-mins 235",
    "--tiktoken-pattern v2",
    "--vocab-file gpt2-vocab.json",
]


def argv_of(line: str, root, *extra: str) -> list[str]:
    """The line with the directories the scripts give (CHECKPOINT_PATH, TENSORBOARD_LOGS_PATH) under
    ``root``."""
    directories = ["--save", f"{root}/ckpt", "--load", f"{root}/ckpt", "--tensorboard-dir", f"{root}/tb"]
    return shlex.split(line) + directories + ["--no-progress", "--plot", ""] + list(extra)


def checked(line: str, root):
    args = parse_args(argv_of(line, root))
    check_args(args, WORLD)
    return args, *core_transformer_config_from_args(args)


def test_each_line_builds_megatron_lms_model(tmp_path):
    # GPT-3: LayerNorm, GeLU, learned positions, a tied output layer, biases, 4 x hidden MLPs; fp16.
    args, config, kwargs = checked(GPT3, tmp_path / "gpt3")
    assert (args.tp, args.pp, args.dp, args.steps) == (2, 2, 1, 3)
    assert (config.normalization, config.gated_linear_unit, config.add_bias_linear) == (
        "LayerNorm",
        False,
        True,
    )
    assert config.ffn_hidden_size == 128 and config.init_method_std == 0.006 and config.fp16
    assert (
        kwargs["position_embedding_type"] == "learned_absolute"
        and kwargs["share_embeddings_and_output_weights"]
    )
    # NullTokenizer: 255 ids and the end of document, padded to 128 x tp
    assert args.null_tokenizer_vocab == 255 and args.vocab_size == 256
    # Llama-3: SwiGLU, GQA with 16-channel heads, rope at base 1e6, untied, no biases, per-token loss.
    args, config, kwargs = checked(LLAMA3, tmp_path / "llama3")
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (2, 16, 224)
    assert config.gated_linear_unit and not config.add_bias_linear and config.calculate_per_token_loss
    assert (args.cp, args.tp, config.sequence_parallel, args.timeout) == (2, 2, True, 3600)
    assert kwargs["rotary_base"] == 1000000 and not kwargs["share_embeddings_and_output_weights"]
    # Mixtral: RMSNorm, 4 experts top-2 with the aux loss; sequence parallelism off at tp 1 (Megatron-LM)
    args, config, kwargs = checked(MIXTRAL, tmp_path / "mixtral")
    assert (config.normalization, config.num_moe_experts, config.moe_router_topk) == ("RMSNorm", 4, 2)
    assert config.moe_aux_loss_coeff == 1e-2 and not config.sequence_parallel
    assert kwargs["max_sequence_length"] == 64 and kwargs["position_embedding_type"] == "rope"
    # DeepSeek: MLA with YaRN (Megatron-LM's default rope type for MLA) at factor 40, MTP, a dense
    # first layer, grouped sigmoid routing with the expert bias and a shared expert.
    args, config, kwargs = checked(DEEPSEEK, tmp_path / "deepseek")
    assert config.multi_latent_attention and config.rope_type == "yarn" and config.rotary_scaling_factor == 40
    assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim, config.mtp_num_layers) == (
        16,
        16,
        16,
        1,
    )
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.moe_router_score_function == "sigmoid"
    assert config.layernorm_epsilon == 1e-6 and config.qk_layernorm and args.vocab_size == 256


def test_what_megatron_ext_lacks_is_refused_by_name(tmp_path):
    for flags in REFUSED:
        name = flags.split()[0]
        with pytest.raises(
            ValueError, match=f"^{name}: Megatron-LM flag that megatron_ext does not implement"
        ):
            parse_args(argv_of(GPT3, tmp_path, *flags.split()))
    with pytest.raises(ValueError, match="^unrecognized argument --tensor-parallel-size "):
        parse_args(["--tensor-parallel-size", "2"])
    with pytest.raises(ValueError, match="invalid choice: 'GPT2BPETokenizer'"):
        parse_args(["--tokenizer-type", "GPT2BPETokenizer"])
    with pytest.raises(
        ValueError, match="--lr-warmup-iters gives a warm-up of 3 steps, not shorter than the decay's 3"
    ):
        check_args(parse_args(["--train-iters", "3", "--lr-warmup-iters", "3"]), 1)
    with pytest.raises(ValueError, match="--min-lr needs a decaying --lr-decay-style"):
        check_args(parse_args(["--min-lr", "1e-5"]), 1)
    with pytest.raises(
        ValueError, match="--start-weight-decay needs --weight-decay-incr-style linear or cosine"
    ):
        check_args(parse_args(["--start-weight-decay", "0.1"]), 1)
    with pytest.raises(ValueError, match="--weight-decay-incr-style linear needs --start-weight-decay and"):
        check_args(parse_args(["--weight-decay-incr-style", "linear"]), 1)
    with pytest.raises(ValueError, match="--timeout and --distributed-timeout-minutes exclude each other"):
        check_args(parse_args(["--timeout", "10", "--distributed-timeout-minutes", "1"]), WORLD)


def _train(lines: dict[str, list[str]]) -> dict:
    train_gpt = load_train_gpt()
    return {name: train_gpt.train(parse_args(argv)) for name, argv in lines.items()}


def cosine_lr(lr: float, min_lr: float, warmup: float, decay: float, samples: float) -> float:
    if warmup > 0 and samples <= warmup:
        return lr * samples / warmup
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


@pytest.mark.slow
def test_the_lines_train(tmp_path):
    runs = {name: argv_of(line, tmp_path / name) for name, line in LINES.items()}
    for name in ("gpt3", "llama3"):
        runs[name] += ["--log-json", str(tmp_path / f"{name}.jsonl")]
    # the GPT-3 line with the short names of its layout and shape: the same run
    long_names = {
        "--tensor-model-parallel-size": "--tp",
        "--pipeline-model-parallel-size": "--pp",
        "--num-layers": "--layers",
        "--hidden-size": "--hidden",
        "--num-attention-heads": "--heads",
        "--seq-length": "--seq-len",
        "--train-iters": "--steps",
    }
    runs["gpt3 short"] = [long_names.get(t, t) for t in argv_of(GPT3, tmp_path / "short")]
    assert set(long_names.values()) <= set(runs["gpt3 short"]) and not set(long_names) & set(
        runs["gpt3 short"]
    )
    logs = run_distributed(WORLD, _train, runs, timeout=600)
    log = logs[0]
    for name in LINES:
        losses = log[name]["losses"]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (name, losses)
        assert all(r[name]["losses"] == losses for r in logs), name  # every rank reports them
    assert log["gpt3 short"]["losses"] == log["gpt3"]["losses"]
    # the evaluations the lines ask for, and the MoE / MTP losses their models log
    assert [s for s, _ in log["llama3"]["val_losses"]] == [2] and [
        s for s, _ in log["deepseek"]["val_losses"]
    ] == [2]
    assert set(log["mixtral"]["aux_losses"][0]) == {"load_balancing_loss"}
    assert set(log["deepseek"]["aux_losses"][0]) == {"seq_load_balancing_loss"}
    assert set(log["deepseek"]["mtp_losses"][0]) == {"mtp_1 loss"}
    # Megatron-LM's cosine schedule in samples (a step is the 8 samples of the global batch): one
    # step of warm-up from 0, then the decay over the three steps' samples
    import json

    def logged(name: str) -> list[dict]:
        records = map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
        return [r for r in records if "step" in r and "event" not in r]

    rates = [r["learning_rate"] for r in logged("llama3")]
    want = [cosine_lr(1.5e-4, 1e-5, 8, 24, 8 * k) for k in range(3)]
    assert want[0] == 0.0 and want[1] == 1.5e-4 and 1e-5 < want[2] < 1.5e-4
    torch.testing.assert_close(
        torch.tensor(rates, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0
    )
    # GPT-3 in fp16: the first steps overflow the initial loss scale and are skipped, which leaves the
    # schedule where it was (at its warm-up's start)
    steps = logged("gpt3")
    assert [s["skipped"] for s in steps] == [True] * 3 and [s["learning_rate"] for s in steps] == [0.0] * 3
