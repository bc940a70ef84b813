"""examples/train_gpt.py with context parallelism: GPT and Llama at (tp, cp, pp, dp) = (1,2,1,1),
(2,2,1,1), (1,2,2,1) (1F1B, interleaved and ZB-V), (1,4,1,1) and (1,2,1,2), every comm type, equal
to the serial run in float64 (per-step losses, gradient norms and the final weights); the
configuration's and the example's refusals."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.transformer import TransformerConfig
from tests.conftest import SMALL, load_train_gpt
from tests.distributed import run_distributed

ARCHS = {"gpt": ["--arch", "gpt"], "llama": ["--arch", "llama", "--num-query-groups", "2"]}
# (tp, cp, pp, dp), the comm type each runs with, and further arguments.
WORLD_2 = [((1, 2, 1, 1), "p2p", ())]
WORLD_4 = [
    ((2, 2, 1, 1), "all_gather", ()),
    ((1, 2, 2, 1), "a2a", ()),
    ((1, 4, 1, 1), "p2p", ()),
    ((1, 2, 1, 2), "all_gather", ()),
    # The distributed optimizer shards over dp x cp (here cp alone).
    ((2, 2, 1, 1), "p2p", ("--sequence-parallel", "--use-distributed-optimizer")),
    ((1, 2, 2, 1), "p2p", ("--virtual-pipeline", "2")),
    # Zero bubble: the backward split into input and weight gradients (the attention's is all in
    # the input part), ZB-V's two chunks per rank.
    ((1, 2, 2, 1), "p2p", ("--schedule", "zb-v")),
]


def _full_weights(models) -> dict[str, list]:
    """The model's weights as the serial model names and holds them: tensor-parallel shards gathered
    (with their stride), pipeline stages' layers under their global numbers; from one rank per
    pipeline stage (tp, cp and dp rank 0), empty elsewhere."""
    tp_group = ps.get_tensor_model_parallel_group()
    tp = tp_group.size()
    out = {}
    for model in models:
        offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
        for name, param in model.named_parameters():
            value = param.detach()
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                shards = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(shards, value.contiguous(), group=tp_group)
                stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
                pieces = [s.chunk(stride, dim) for s in shards]
                value = torch.cat([pieces[r][j] for j in range(stride) for r in range(tp)], dim)
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            out[".".join(parts)] = value.tolist()
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    return out if first and ps.get_data_parallel_rank() == 0 else {}


def _train(layouts: list, archs: list[str]) -> dict:
    """Per (layout, comm, arch): losses, gradient norms and final weights (merged over ranks by the
    test)."""
    train_gpt = load_train_gpt()
    built = []
    build = train_gpt.build_model
    train_gpt.build_model = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    # train() ends by destroying the groups: the trained weights are gathered just before.
    weights, destroy = [], ps.destroy_model_parallel

    def gather_then_destroy() -> None:
        if len(weights) < len(built):
            weights.append(_full_weights(built[-1]))
        destroy()

    train_gpt.parallel_state = types.SimpleNamespace(**vars(ps))
    train_gpt.parallel_state.destroy_model_parallel = gather_then_destroy
    out = {}
    for (tp, cp, pp, dp), comm, extra in layouts:
        for arch in archs:
            args = train_gpt.parse_args(
                SMALL
                + ARCHS[arch]
                + [
                    "--tp",
                    str(tp),
                    "--cp",
                    str(cp),
                    "--pp",
                    str(pp),
                    "--dp",
                    str(dp),
                    "--dtype",
                    "float64",
                    "--cp-comm-type",
                    comm,
                    *extra,
                ]
            )
            log = train_gpt.train(args)
            out[((tp, cp, pp, dp), comm, extra, arch)] = (log["losses"], log["grad_norms"], weights[-1])
    return out


def _merged(results: list[dict]) -> dict:
    merged = {}
    for rank_result in results:
        for key, (losses, norms, weights) in rank_result.items():
            entry = merged.setdefault(key, (losses, norms, {}))
            entry[2].update(weights)
    return merged


def _assert_equal_serial(reference: dict, results: dict) -> None:
    for (layout, comm, extra, arch), (losses, norms, weights) in results.items():
        ref_losses, ref_norms, ref_weights = reference[((1, 1, 1, 1), "p2p", (), arch)]
        label = f"{arch} (tp, cp, pp, dp)={layout} {comm} {' '.join(extra)}"
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(ref_losses),
            rtol=1e-9,
            atol=0,
            msg=lambda m: f"{label} losses: {m}",
        )
        torch.testing.assert_close(
            torch.tensor(norms),
            torch.tensor(ref_norms),
            rtol=1e-9,
            atol=0,
            msg=lambda m: f"{label} grad norms: {m}",
        )
        assert len(ref_weights) > 10 and set(ref_weights) <= set(weights), (
            label,
            set(ref_weights) - set(weights),
        )
        for name, value in ref_weights.items():
            torch.testing.assert_close(
                torch.tensor(weights[name]),
                torch.tensor(value),
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m: f"{label} {name}: {m}",
            )


@pytest.fixture(scope="module")
def serial():
    (ref,) = run_distributed(1, _train, [((1, 1, 1, 1), "p2p", ())], list(ARCHS))
    return ref


@pytest.mark.slow  # a serial and a 2-rank group, each training GPT and Llama
def test_cp2_trains_like_serial(serial):
    _assert_equal_serial(serial, _merged(run_distributed(2, _train, WORLD_2, list(ARCHS))))


@pytest.mark.slow
def test_cp_layouts_train_like_serial(serial):
    results = _merged(run_distributed(4, _train, WORLD_4, list(ARCHS), timeout=900))
    assert len(results) == 2 * len(WORLD_4)
    _assert_equal_serial(serial, results)


def _config(**kwargs) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, context_parallel_size=2, **kwargs
    )


def test_config_cp_comm_type():
    assert _config(cp_comm_type=["p2p", "a2a"]).cp_comm_type == ["p2p", "a2a"]
    with pytest.raises(ValueError, match=r"cp_comm_type has 3 entries.*num_layers=2"):
        _config(cp_comm_type=["p2p"] * 3)
    with pytest.raises(ValueError, match=r"got 'ring'"):
        _config(cp_comm_type="ring")
    with pytest.raises(NotImplementedError, match=r"a2a\+p2p"):
        _config(cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match=r"4 query heads and 1 key/value groups .* both must divide by 2"):
        _config(cp_comm_type="a2a", num_query_groups=1)


def _bad_arguments_worker(cases):
    train_gpt = load_train_gpt()
    messages = []
    for argv in cases:
        try:
            train_gpt.check_args(train_gpt.parse_args(SMALL + argv), dist.get_world_size())
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_bad_cp_arguments_raise_on_every_rank():
    cases = [
        (["--cp", "2", "--pp", "1", "--seq-len", "14"], "--seq-len 14 is not divisible by 2 x --cp = 4"),
        (
            [
                "--cp",
                "2",
                "--pp",
                "1",
                "--cp-comm-type",
                "a2a",
                "--heads",
                "2",
                "--hidden",
                "32",
                "--num-query-groups",
                "1",
            ],
            "a2a splits each tensor-parallel rank's 2 query heads and 1 key/value groups over --cp 2",
        ),
        (["--cp", "4"], "world size 2 is not divisible by tp x cp x pp = 1 x 4 x 1"),
        (["--cp", "2", "--dropout", "0.1", "--pp", "1"], "attention dropout is not supported"),
    ]
    for messages in run_distributed(2, _bad_arguments_worker, [["--tp", "1", *argv] for argv, _ in cases]):
        for message, (_, expected) in zip(messages, cases):
            assert expected in message, (expected, message)


def _mask_worker() -> str:
    """An attention mask under cp is refused (the layer is causal and the sequence split)."""
    from megatron_ext.transformer import ParallelAttention

    ps.initialize_model_parallel(context_parallel_size=2)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        context_parallel_size=2,
        use_cpu_initialization=True,
    )
    attention = ParallelAttention(config)
    try:
        attention(torch.randn(4, 1, 16), attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool))
    except ValueError as e:
        return str(e)
    return "no error"


def test_attention_mask_with_cp_raises_on_every_rank():
    for message in run_distributed(2, _mask_worker):
        assert "context_parallel_size=2 the attention is causal and takes no attention_mask" in message
