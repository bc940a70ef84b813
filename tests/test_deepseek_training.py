"""examples/train_gpt.py --arch deepseek: a DeepSeek-V3-style model (multi-latent attention with YaRN
and query compression; a dense first layer, then experts with a shared expert and group-limited
sigmoid routing with the expert bias; one multi-token prediction depth) trained at (tp, cp, pp, ep,
dp) = (2,1,1,1,1), (1,2,1,1,1), (1,1,2,1,1), (1,1,1,2,1), (2,1,1,2,1) (tensor-parallel runs with
sequence parallelism) and (1,1,1,1,2) with the distributed optimizer equals the serial run in float64:
per-step losses, multi-token prediction losses and gradient norms, final weights (experts by global
index) and expert biases; so does pp 2 with 2 virtual stages (the depths on the last chunk), for it
and a Llama model with two depths; the refusals of bad multi-latent attention and multi-token
prediction flags on every rank."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.transformer.moe import MoELayer
from tests.conftest import load_train_gpt
from tests.distributed import run_distributed
from tests.test_moe_training import _check_messages, _gather, _merged

DEEPSEEK = [
    "--arch", "deepseek", "--layers", "2", "--hidden", "16", "--heads", "2", "--ffn-hidden", "12",
    "--q-lora-rank", "8", "--kv-lora-rank", "6", "--qk-head-dim", "4", "--qk-pos-emb-head-dim", "4",
    "--v-head-dim", "6", "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9",
    "--mscale-all-dim", "0.8", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
    "--moe-router-bias-update-rate", "1e-2", "--moe-aux-loss-coeff", "1e-2", "--mtp-num-layers", "1",
    # two groups of two experts, the best group chosen: the top 2 within it
    "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--seq-len", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--steps", "3", "--lr", "1e-2",
    "--clip-grad", "0.5", "--dtype", "float64", "--no-progress", "--plot", "",
]
# (tp, cp, pp, ep, dp) -> flags (the world: tp x cp x pp x dp; ep within it)
LAYOUTS = {
    (1, 1, 1, 1, 1): ["--tp", "1", "--pp", "1"],
    (2, 1, 1, 1, 1): ["--tp", "2", "--pp", "1", "--sequence-parallel"],
    (1, 2, 1, 1, 1): ["--tp", "1", "--pp", "1", "--cp", "2"],
    (1, 1, 2, 1, 1): ["--tp", "1", "--pp", "2"],
    (1, 1, 1, 2, 1): ["--tp", "1", "--pp", "1", "--ep", "2", "--dp", "2"],
    (2, 1, 1, 2, 1): ["--tp", "2", "--pp", "1", "--ep", "2", "--sequence-parallel", "--dp", "2"],
    (1, 1, 1, 1, 2): ["--tp", "1", "--pp", "1", "--use-distributed-optimizer"],
}


def _layers(model):
    mtp = [depth.transformer_layer for depth in model.mtp.layers] if model.mtp_process else []
    return list(model.decoder.layers) + mtp


def _full_weights(models) -> dict[str, list]:
    """The model's weights under the serial model's names (the routed experts by global index,
    gathered over the expert groups) and the routers' expert biases; from tp, cp and dp rank 0 of
    each pipeline stage."""
    tp_group = ps.get_tensor_model_parallel_group()
    etp_group, ep_group = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    out = {}
    for model in models:
        offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
        for name, param in model.named_parameters():
            if not getattr(param, "allreduce", True):
                continue  # an expert's
            value = param.detach()
            if getattr(param, "tensor_model_parallel", False):
                value = _gather(value, tp_group, param.partition_dim, getattr(param, "partition_stride", 1))
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            out[".".join(parts)] = value.tolist()
        for layer in _layers(model):
            if not isinstance(getattr(layer, "mlp", None), MoELayer):
                continue
            out[f"layer {layer.layer_number} expert bias"] = layer.mlp.router.expert_bias.tolist()
            local = [(_gather(w1.detach(), etp_group, 0, 2).tolist(),
                      _gather(w2.detach(), etp_group, 1, 1).tolist())
                     for w1, w2 in layer.mlp.experts.expert_weights()]
            everyone = [None] * dist.get_world_size(ep_group)
            dist.all_gather_object(everyone, local, group=ep_group)
            for e, (w1, w2) in enumerate(w for rank in everyone for w in rank):
                out[f"layer {layer.layer_number} expert {e} w1"] = w1
                out[f"layer {layer.layer_number} expert {e} w2"] = w2
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    return out if first and ps.get_data_parallel_rank() == 0 else {}


def _train(layouts: list, base: list[str] = DEEPSEEK, flags: dict = LAYOUTS) -> dict:
    train_gpt = load_train_gpt()
    built, weights = [], []
    build, destroy = train_gpt.build_model, ps.destroy_model_parallel
    train_gpt.build_model = lambda *a, **k: built.append(build(*a, **k)) or built[-1]

    wrappers: list = []  # fully sharded parameters are gathered before they are read

    class Recorded(train_gpt.FullyShardedDataParallel):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            wrappers.append(self)

    def gather_then_destroy() -> None:
        if len(weights) < len(built):
            for wrapper in wrappers:
                wrapper.gather_all_params()
            weights.append(_full_weights(built[-1]))
        wrappers.clear()
        destroy()

    train_gpt.FullyShardedDataParallel = Recorded
    train_gpt.parallel_state = types.SimpleNamespace(**vars(ps))
    train_gpt.parallel_state.destroy_model_parallel = gather_then_destroy
    out = {}
    for layout in layouts:
        args = train_gpt.parse_args(base + flags[layout])
        log = train_gpt.train(args)
        mtp = [[d[name] for name in sorted(d)] for d in log["mtp_losses"]]
        out[layout] = (log["losses"], mtp, log["grad_norms"], weights[-1])
    return out


# The multi-token prediction losses are logged in float32, as Megatron-core's tracker keeps them:
# sums of a few float32-rounded terms (2^-24 each), added in another order in another layout.
MTP_RTOL = 1e-6


@pytest.mark.slow  # a serial, a 2-rank and a 4-rank group: 7 trainings of 3 steps
def test_deepseek_model_trains_like_serial_in_every_layout():
    (serial,) = run_distributed(1, _train, [(1, 1, 1, 1, 1)])
    ref_losses, ref_mtp, ref_norms, ref_weights = serial[(1, 1, 1, 1, 1)]
    assert len(ref_losses) == 3 and len(ref_mtp) == 3 and all(len(m) == 1 for m in ref_mtp)
    assert ref_mtp[-1][0] < ref_mtp[0][0] and ref_losses[-1] < ref_losses[0], (ref_losses, ref_mtp)
    assert any("mtp.layers.0.transformer_layer.self_attention" in name for name in ref_weights)
    assert "layer 3 expert bias" in ref_weights  # the multi-token prediction layer is an MoE layer
    world_2 = [(2, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 2, 1, 1), (1, 1, 1, 2, 1), (1, 1, 1, 1, 2)]
    results = {**_merged(run_distributed(2, _train, world_2, timeout=900)),
               **_merged(run_distributed(4, _train, [(2, 1, 1, 2, 1)], timeout=900))}
    assert len(results) == 6
    for layout, (losses, mtp, norms, weights) in results.items():
        for what, got, want, rtol in (("losses", losses, ref_losses, 1e-9),
                                      ("mtp losses", mtp, ref_mtp, MTP_RTOL),
                                      ("grad norms", norms, ref_norms, 1e-9)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=0,
                                       msg=lambda m: f"{layout} {what}: {m}")
        assert set(weights) == set(ref_weights), (layout, set(weights) ^ set(ref_weights))
        for name, value in ref_weights.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-9,
                                       atol=1e-12, msg=lambda m: f"{layout} {name}: {m}")


# A Llama model with two multi-token prediction depths, and both architectures at 4 layers: the
# interleaved layout (pp 2, 2 virtual stages) puts the depths on the last chunk of the last stage.
LLAMA_MTP = [
    "--arch", "llama", "--hidden", "16", "--heads", "2", "--ffn-hidden", "12", "--mtp-num-layers", "2",
    "--mtp-loss-scaling-factor", "0.3", "--seq-len", "8", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--steps", "3", "--lr", "1e-2", "--dtype", "float64", "--no-progress",
    "--plot", "",
]
INTERLEAVED = {
    ("deepseek", "serial"): ["--layers", "4", "--tp", "1", "--pp", "1"],
    ("deepseek", "interleaved"): ["--layers", "4", "--tp", "1", "--pp", "2", "--virtual-pipeline", "2"],
    ("llama", "serial"): ["--layers", "4", "--tp", "1", "--pp", "1"],
    ("llama", "interleaved"): ["--layers", "4", "--tp", "1", "--pp", "2", "--virtual-pipeline", "2"],
}


def _train_both(runs: list[tuple]) -> dict:
    out = {}
    for run in runs:
        out.update(_train([run], DEEPSEEK if run[0] == "deepseek" else LLAMA_MTP, INTERLEAVED))
    return out


def test_mtp_with_interleaved_pipeline_trains_like_serial():
    (serial,) = run_distributed(1, _train_both, [("deepseek", "serial"), ("llama", "serial")])
    runs = [("deepseek", "interleaved"), ("llama", "interleaved")]
    interleaved = _merged(run_distributed(2, _train_both, runs, timeout=900))
    for arch, depths in (("deepseek", 1), ("llama", 2)):
        ref_losses, ref_mtp, ref_norms, ref_weights = serial[(arch, "serial")]
        losses, mtp, norms, weights = interleaved[(arch, "interleaved")]
        assert len(ref_losses) == 3 and all(len(m) == depths for m in ref_mtp), (arch, ref_mtp)
        assert all(v > 0 for m in ref_mtp for v in m) and all(n > 0 for n in ref_norms), (arch, ref_mtp)
        for what, got, want in (("losses", losses, ref_losses), ("mtp losses", mtp, ref_mtp),
                                ("grad norms", norms, ref_norms)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=0,
                                       msg=lambda m: f"{arch} {what}: {m}")
        assert set(weights) == set(ref_weights), (arch, set(weights) ^ set(ref_weights))
        for name, value in ref_weights.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-9,
                                       atol=1e-12, msg=lambda m: f"{arch} {name}: {m}")


BAD = [
    (["--qk-pos-emb-head-dim", "3", "--tp", "1", "--pp", "1"], "--qk-pos-emb-head-dim 3 must be even"),
    (["--kv-lora-rank", "0", "--tp", "1", "--pp", "1"], "--kv-lora-rank must be >= 1, got 0"),
    (["--num-query-groups", "1", "--tp", "1", "--pp", "1"], "every query head has its own key and value"),
    (["--mtp-num-layers", "0", "--tp", "1", "--pp", "1"], "--mtp-num-layers must be >= 1, got 0"),
    (["--arch", "gpt", "--multi-latent-attention", "--tp", "1", "--pp", "2"],
     "the last stage would need its own copy of the position"),
    (["--arch", "llama", "--q-lora-rank", "4", "--mtp-num-layers", "1", "--tp", "1", "--pp", "1"],
     "--q-lora-rank 4 needs --multi-latent-attention"),
]


def test_bad_deepseek_arguments_raise_the_same_on_every_rank():
    first, second = run_distributed(2, _check_messages, [argv for argv, _ in BAD], 2, DEEPSEEK)
    assert first == second
    for message, (argv, expected) in zip(first, BAD):
        assert expected in message, (argv, message)


def _checkpoint_worker(save_dir: str) -> tuple[tuple, dict]:
    """Trains 4 steps at pp 2 saving after step 2, then resumes that checkpoint at other layouts."""
    import os

    train_gpt = load_train_gpt()

    def run(*flags: str) -> dict:
        return train_gpt.train(train_gpt.parse_args(DEEPSEEK + ["--steps", "4", *flags]))

    full = run("--tp", "1", "--pp", "2", "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {}
    for name, flags in RESUME_LAYOUTS.items():
        log = run(*flags, "--load", ckpt)
        resumed[name] = (log["start_step"], log["losses"], log["mtp_losses"])
    return (full["losses"], full["mtp_losses"]), resumed


RESUME_LAYOUTS = {
    "serial-shaped (dp 2)": ["--tp", "1", "--pp", "1"],
    "tp 2": ["--tp", "2", "--pp", "1", "--sequence-parallel"],
    "ep 2": ["--tp", "1", "--pp", "1", "--ep", "2"],
}


@pytest.mark.slow  # a 2-rank group, 4 trainings
def test_deepseek_checkpoint_resumes_at_other_layouts(tmp_path):
    (full, full_mtp), resumed = run_distributed(2, _checkpoint_worker, str(tmp_path / "run"), timeout=900)[0]
    assert len(full) == 4 and len(full_mtp) == 4
    for name, (start, losses, mtp) in resumed.items():
        assert start == 2 and len(losses) == 2, name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(full[2:]), rtol=1e-9, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        assert mtp == full_mtp[2:] or torch.allclose(
            torch.tensor([list(d.values()) for d in mtp]),
            torch.tensor([list(d.values()) for d in full_mtp[2:]]), rtol=MTP_RTOL, atol=0,
        ), (name, mtp, full_mtp)


def _export_and_load_worker(hf_dir: str) -> tuple[list[float], list[float]]:
    """--arch deepseek trained one step at lr 0 (no expert-bias update) and exported, then that
    directory trained by --load-hf alone: the same model, the same first batch."""
    train_gpt = load_train_gpt()
    batch = ["--seq-len", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--steps", "1",
             "--lr", "0", "--dtype", "float64", "--no-progress", "--plot", "", "--tp", "1", "--pp", "1"]
    exported = train_gpt.train(train_gpt.parse_args(
        DEEPSEEK + batch + ["--moe-router-bias-update-rate", "0", "--export-hf", hf_dir]))
    loaded = train_gpt.train(train_gpt.parse_args(batch + ["--load-hf", hf_dir]))
    return exported["losses"], loaded["losses"]


@pytest.mark.slow  # a 2-rank group, 2 trainings
def test_deepseek_export_trains_again_by_load_hf(tmp_path):
    """docs/deepseek.md's flow: --arch deepseek --export-hf, then --load-hf of that directory (its
    norm epsilon DeepSeek's 1e-6, the one config_from_hf accepts for DeepSeek models)."""
    exported, loaded = run_distributed(2, _export_and_load_worker, str(tmp_path / "hf"), timeout=600)[0]
    assert len(exported) == len(loaded) == 1
    torch.testing.assert_close(torch.tensor(loaded), torch.tensor(exported), rtol=1e-12, atol=0)
