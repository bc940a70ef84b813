"""examples/train_gpt.py with mixture-of-experts layers: expert parallelism at (ep, etp, tp, pp, dp)
= (2,1,1,1,1), (4,1,1,1,1), (2,1,2,1,1), (2,2,2,1,1), (2,1,1,2,1), (2,1,1,1,2) with the
distributed optimizer, both dispatchers and both expert implementations, equal to the serial run
in float64 (per-step losses, load-balancing losses, gradient norms and the final weights, experts
by global index); token dropping by capacity equal to the serial run's; the refusals of bad MoE
flags on every rank."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.transformer.moe import MoELayer
from tests.conftest import load_train_gpt
from tests.distributed import run_distributed

TINY = [
    "--tp",
    "1",
    "--pp",
    "1",
    "--layers",
    "2",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--steps",
    "3",
    "--lr",
    "1e-2",
    "--no-progress",
    "--plot",
    "",
    "--dtype",
    "float64",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--clip-grad",
    "0.5",
]
ARCHS = {"llama": ["--arch", "llama", "--ffn-hidden", "12"], "gpt": ["--arch", "gpt"]}
# (ep, etp, tp, pp, cp) -> flags; dp is what the world leaves.
LAYOUT_FLAGS = {
    (1, 1, 1, 1, 1): [],
    (2, 1, 1, 1, 1): ["--ep", "2"],
    (4, 1, 1, 1, 1): ["--ep", "4"],
    (2, 1, 2, 1, 1): ["--ep", "2", "--etp", "1", "--tp", "2", "--sequence-parallel"],
    (2, 2, 2, 1, 1): ["--ep", "2", "--etp", "2", "--tp", "2", "--sequence-parallel"],
    (2, 1, 1, 2, 1): ["--ep", "2", "--pp", "2"],
    (1, 1, 1, 1, 2): ["--cp", "2"],
    (2, 1, 1, 1, 2): ["--cp", "2", "--ep", "2"],
    (2, 1, 2, 1, 2): ["--cp", "2", "--ep", "2", "--etp", "1", "--tp", "2", "--sequence-parallel"],
    (1, 1, 1, 2, 1): ["--pp", "2"],
}
VARIANTS = {
    "allgather": ["--moe-token-dispatcher-type", "allgather"],
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "allgather grouped": ["--moe-token-dispatcher-type", "allgather", "--moe-grouped-gemm"],
    "alltoall grouped": ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"],
}
CAPACITY = ["--moe-expert-capacity-factor", "0.75"]


def _gather(value: torch.Tensor, group, dim: int, stride: int) -> torch.Tensor:
    """The full tensor from the shards of ``group`` (stride-``stride`` split along ``dim``)."""
    size = dist.get_world_size(group)
    if size == 1:
        return value
    shards = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(shards, value.contiguous(), group=group)
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(size)], dim)


def _full_weights(models) -> dict[str, list]:
    """The model's weights as the serial model names them; each MoE layer's experts as
    ``...mlp.experts.<global index>.w1`` / ``.w2`` (and ``.b1`` / ``.b2``) gathered over etp and
    ep; from tp, cp and dp rank 0 of each pipeline stage, empty elsewhere."""
    tp_group = ps.get_tensor_model_parallel_group()
    etp_group, ep_group = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    out = {}
    for model in models:
        offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
        for name, param in model.named_parameters():
            if not getattr(param, "allreduce", True):
                continue
            value = param.detach()
            if getattr(param, "tensor_model_parallel", False):
                value = _gather(value, tp_group, param.partition_dim, getattr(param, "partition_stride", 1))
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            out[".".join(parts)] = value.tolist()
        for layer in model.decoder.layers:
            if not isinstance(layer.mlp, MoELayer):
                continue
            gated = bool(layer.config.gated_linear_unit)
            local = [
                (
                    _gather(w1.detach(), etp_group, 0, 2 if gated else 1).tolist(),
                    _gather(w2.detach(), etp_group, 1, 1).tolist(),
                )
                for w1, w2 in layer.mlp.experts.expert_weights()
            ]
            # fc1's bias split like fc1's rows, fc2's whole on every etp rank.
            biases = [
                (_gather(b1.detach(), etp_group, 0, 2 if gated else 1).tolist(), b2.detach().tolist())
                for b1, b2 in layer.mlp.experts.expert_biases()
            ]
            everyone = [None] * dist.get_world_size(ep_group)
            dist.all_gather_object(everyone, (local, biases), group=ep_group)
            experts = [w for rank in everyone for w in rank[0]]
            prefix = f"decoder.layers.{layer.layer_number - 1}.mlp.experts"
            for e, (w1, w2) in enumerate(experts):
                out[f"{prefix}.{e}.w1"] = w1
                out[f"{prefix}.{e}.w2"] = w2
            for e, (b1, b2) in enumerate(b for rank in everyone for b in rank[1]):
                out[f"{prefix}.{e}.b1"] = b1
                out[f"{prefix}.{e}.b2"] = b2
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    return out if first and ps.get_data_parallel_rank() == 0 else {}


def _train(runs: list[tuple]) -> dict:
    """Per run (layout, variant, arch, extra flags): losses, aux losses, grad norms, final weights."""
    train_gpt = load_train_gpt()
    built = []
    build = train_gpt.build_model
    train_gpt.build_model = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    weights, destroy = [], ps.destroy_model_parallel

    def gather_then_destroy() -> None:
        if len(weights) < len(built):
            weights.append(_full_weights(built[-1]))
        destroy()

    train_gpt.parallel_state = types.SimpleNamespace(**vars(ps))
    train_gpt.parallel_state.destroy_model_parallel = gather_then_destroy
    out = {}
    for layout, variant, arch, extra in runs:
        optimizer = ["--use-distributed-optimizer"] if layout != (1, 1, 1, 1, 1) else []
        args = train_gpt.parse_args(
            TINY + ARCHS[arch] + LAYOUT_FLAGS[layout] + VARIANTS[variant] + optimizer + list(extra)
        )
        log = train_gpt.train(args)
        aux = [[d[name] for name in sorted(d)] for d in log["aux_losses"]]  # balance, z, per-sequence
        out[(layout, variant, arch, tuple(extra))] = (log["losses"], aux, log["grad_norms"], weights[-1])
    return out


def _merged(results: list[dict]) -> dict:
    merged = {}
    for rank_result in results:
        for key, (losses, aux, norms, weights) in rank_result.items():
            merged.setdefault(key, (losses, aux, norms, {}))[3].update(weights)
    return merged


def _assert_equal_serial(reference: dict, results: dict) -> None:
    for (layout, variant, arch, extra), (losses, aux, norms, weights) in results.items():
        ref_losses, ref_aux, ref_norms, ref_weights = reference[((1, 1, 1, 1, 1), "allgather", arch, extra)]
        label = f"{arch} (ep, etp, tp, pp, cp)={layout} {variant} {' '.join(extra)}"
        for what, got, want in (
            ("losses", losses, ref_losses),
            ("aux losses", aux, ref_aux),
            ("grad norms", norms, ref_norms),
        ):
            torch.testing.assert_close(
                torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=0, msg=lambda m: f"{label} {what}: {m}"
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


# The router's losses all on (the balance loss of TINY, the z-loss; per sequence; with the
# sigmoid router's expert bias): their gradients must carry the main loss's scale in every layout
# (1 / micro-batches, times cp for the context-parallel ranks' shares).
LOSSES = {
    "aux z": ("--moe-z-loss-coeff", "1e-3"),
    "seq_aux z": ("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-z-loss-coeff", "1e-3"),
    "sigmoid expert-bias aux z": ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                  "--moe-router-bias-update-rate", "1e-2", "--moe-z-loss-coeff", "1e-3"),
}
SERIAL_RUNS = [
    ((1, 1, 1, 1, 1), "allgather", arch, extra) for arch in ARCHS for extra in ((), tuple(CAPACITY))
] + [((1, 1, 1, 1, 1), "allgather", "llama", losses) for losses in LOSSES.values()]
WORLD_2 = (
    [((2, 1, 1, 1, 1), v, "llama", ()) for v in VARIANTS]
    + [((2, 1, 2, 1, 1), v, "llama", ()) for v in VARIANTS]
    + [((2, 1, 1, 1, 1), v, "gpt", ()) for v in ("allgather", "alltoall")]
    + [((2, 1, 1, 1, 1), v, "llama", tuple(CAPACITY)) for v in ("allgather", "alltoall")]
)
WORLD_4 = (
    [((4, 1, 1, 1, 1), v, "llama", ()) for v in VARIANTS]
    + [((2, 2, 2, 1, 1), v, "llama", ()) for v in VARIANTS]
    + [((2, 1, 1, 2, 1), v, "llama", ()) for v in VARIANTS]
    + [((2, 1, 1, 1, 1), v, "llama", ()) for v in VARIANTS]  # dp 4: expert-data-parallel size 2
    + [((2, 2, 2, 1, 1), "alltoall", "gpt", ())]
)


@pytest.fixture(scope="module")
def serial():
    (ref,) = run_distributed(1, _train, SERIAL_RUNS)
    assert ref[((1, 1, 1, 1, 1), "allgather", "llama", ())][1][0][0] > 0.5  # the balance loss is tracked
    # (load_balancing_loss or seq_load_balancing_loss, z_loss)
    tracked = [ref[((1, 1, 1, 1, 1), "allgather", "llama", losses)][1][0] for losses in LOSSES.values()]
    assert [len(values) for values in tracked] == [2, 2, 2]
    return ref


@pytest.mark.slow  # a serial and a 2-rank group, 14 trainings
def test_expert_parallel_world_2_trains_like_serial(serial):
    results = _merged(run_distributed(2, _train, WORLD_2, timeout=900))
    assert len(results) == len(WORLD_2)
    _assert_equal_serial(serial, results)
    # Dropping changes the run: the reference with a capacity differs from the dropless one.
    dropless, dropped = (serial[((1, 1, 1, 1, 1), "allgather", "llama", e)][0] for e in ((), tuple(CAPACITY)))
    assert abs(dropless[-1] - dropped[-1]) > 1e-6


@pytest.mark.slow  # a 4-rank group, 17 trainings
def test_expert_parallel_world_4_trains_like_serial(serial):
    results = _merged(run_distributed(4, _train, WORLD_4, timeout=1200))
    assert len(results) == len(WORLD_4)
    _assert_equal_serial(serial, results)


# Context parallelism (its ranks' shares of the router's losses), alone and with expert and
# tensor parallelism, and pipeline parallelism (4 micro-batches), with every router loss on.
LOSS_LAYOUTS_2 = [(1, 1, 1, 1, 2), (2, 1, 1, 1, 2), (1, 1, 1, 2, 1)]
LOSS_LAYOUTS_4 = [(2, 1, 2, 1, 2)]


@pytest.mark.slow  # a 2-rank and a 4-rank group, 12 trainings
def test_router_losses_train_like_serial_with_context_and_pipeline_parallelism(serial):
    for world, layouts in ((2, LOSS_LAYOUTS_2), (4, LOSS_LAYOUTS_4)):
        runs = [(layout, "alltoall", "llama", losses) for layout in layouts for losses in LOSSES.values()]
        results = _merged(run_distributed(world, _train, runs, timeout=900))
        assert len(results) == len(runs)
        _assert_equal_serial(serial, results)


def _check_messages(cases: list[list[str]], world_size: int, base: list[str] | None = None) -> list[str]:
    """check_args' error for each argument list after ``base`` (default: the tiny model's shape) (the
    same on every rank: it reads only the arguments and the world size)."""
    train_gpt = load_train_gpt()
    base = TINY[:-8] if base is None else base
    messages = []
    for argv in cases:
        try:
            train_gpt.check_args(train_gpt.parse_args(base + argv), world_size)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


BAD = [
    (
        ["--num-experts", "6", "--ep", "4", "--tp", "1", "--pp", "1"],
        "--num-experts 6 is not divisible by --ep 4",
    ),
    (
        ["--num-experts", "4", "--moe-router-topk", "5", "--tp", "1", "--pp", "1"],
        "--moe-router-topk 5 must be between 1 and --num-experts 4",
    ),
    (
        ["--num-experts", "4", "--ep", "4", "--tp", "1", "--pp", "1"],
        "--etp x --ep x --pp = 1 x 4 x 1 = 4 does not divide the world size 2",
    ),
    (
        ["--num-experts", "4", "--ep", "2", "--etp", "2", "--tp", "1", "--pp", "1"],
        "--etp x --ep x --pp = 2 x 2 x 1 = 4 does not divide the world size 2",
    ),
    (["--ep", "2", "--tp", "1", "--pp", "1"], "--ep 2 needs --num-experts"),
    (["--num-experts", "4", "--tp", "2", "--pp", "1"], "needs --sequence-parallel"),
    # GroupedMLP has biases: accepted
    (["--num-experts", "4", "--moe-grouped-gemm", "--tp", "1", "--pp", "1", "--arch", "gpt"], "no error"),
]


def test_bad_moe_arguments_raise():
    messages = _check_messages([argv for argv, _ in BAD], world_size=2)
    for message, (argv, expected) in zip(messages, BAD):
        assert expected in message, (argv, message)


def _checkpoint_worker(save_dir: str) -> tuple[list[float], dict]:
    """Trains 4 steps at ep 2 with GroupedMLP experts (distributed optimizer) saving after step 2,
    then resumes that checkpoint at other expert layouts and implementations (SequentialMLP among
    them: both store each expert under the same keys)."""
    train_gpt = load_train_gpt()

    def run(*flags: str) -> dict:
        argv = TINY + ARCHS["llama"] + ["--steps", "4", "--use-distributed-optimizer", *flags]
        return train_gpt.train(train_gpt.parse_args(argv))

    full = run("--ep", "2", "--moe-grouped-gemm", "--save", save_dir, "--save-interval", "2")["losses"]
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {}
    for name, flags in RESUME_LAYOUTS.items():
        log = run(*flags, "--load", ckpt)
        resumed[name] = (log["start_step"], log["losses"])
    return full, resumed


RESUME_LAYOUTS = {
    "ep 1": [],
    "ep 2 grouped alltoall": ["--ep", "2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"],
    "tp 2 etp 2 ep 1": ["--tp", "2", "--sequence-parallel", "--etp", "2"],
    "tp 2 etp 1 ep 2": ["--tp", "2", "--sequence-parallel", "--etp", "1", "--ep", "2"],
}


@pytest.mark.slow  # a 2-rank group, 5 trainings
def test_checkpoint_resumes_at_other_expert_layouts(tmp_path):
    full, resumed = run_distributed(2, _checkpoint_worker, str(tmp_path / "run"), timeout=900)[0]
    assert len(full) == 4
    for name, (start, losses) in resumed.items():
        assert start == 2 and len(losses) == 2, name
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(full[2:]), rtol=1e-9, atol=0, msg=lambda m: f"{name}: {m}"
        )
