"""Sharded checkpoints: a run saved at one (tp, pp, dp, cp) layout and resumed at another computes the
uninterrupted run's losses (float64, 1e-9); saves are atomic; checkpoints of another model or
with a corrupted file are refused on every rank; the unsharded conversion round-trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT, SMALL, checkpoint_args, checkpoint_run, load_train_gpt
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # trains the example GPT, saves and resumes at many layouts

def _save_then_resume_worker(save_dir: str, layouts, dropout: str):
    """Trains 4 steps at tp 2 x pp 2 saving after step 2, then resumes that checkpoint at each of
    ``layouts`` (with this world size); returns the uninterrupted and the resumed losses."""
    full = (
        checkpoint_run((2, 2, 1), "--save", save_dir, "--save-interval", "2", "--dropout", dropout)
        if dist.get_world_size() == 4
        else None
    )
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {
        layout: checkpoint_run(layout[:3], "--load", ckpt, "--dropout", dropout, *layout[3:])
        for layout in layouts
    }
    return full, {k: (v["start_step"], v["losses"]) for k, v in resumed.items()}


@pytest.fixture(scope="module")
def saved_at_tp2_pp2(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    layouts = [
        (2, 2, 1),
        (1, 4, 1),
        (2, 1, 2),
        (1, 2, 2),
        (2, 2, 1, "--sequence-parallel"),
        (1, 2, 2, "--virtual-pipeline", "2"),
        (2, 2, 1, "--schedule", "zb-v"),
        (1, 1, 2, "--cp", "2"),  # cp ranks are replicas: a cp 1 checkpoint loads at cp 2
        (1, 2, 1, "--cp", "2"),
    ]
    results = run_distributed(4, _save_then_resume_worker, save_dir, layouts, "0.0")
    full, resumed = results[0]
    for r in results[1:]:  # every rank reports the same global losses
        assert r[1] == resumed
    return save_dir, full, resumed


def _assert_resumed_equal(full_losses, start, losses):
    assert start == 2 and len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full_losses[2:]), rtol=1e-9, atol=0)


def test_resume_at_other_layouts_matches_uninterrupted(saved_at_tp2_pp2):
    save_dir, full, resumed = saved_at_tp2_pp2
    assert len(full["losses"]) == 4 and full["losses"][-1] < full["losses"][0]
    for start, losses in resumed.values():
        _assert_resumed_equal(full["losses"], start, losses)
    # the serial run (one process) resumes the same checkpoint
    ((_, serial),) = run_distributed(1, _save_then_resume_worker, save_dir, [(1, 1, 1)], "0.0")
    _assert_resumed_equal(full["losses"], *serial[(1, 1, 1)])
    # the final save (after step 4) is the newest
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "4"
    with open(os.path.join(save_dir, "iter_0000002", "checkpoint.json")) as f:
        marker = json.load(f)
    assert marker["iteration"] == 2 and marker["layout"] == {"tp": 2, "pp": 2, "dp": 1, "cp": 1, "vpp": 1}
    assert marker["metadata"]["data"]["consumed_samples"] == 16


def test_same_layout_restores_rng_streams(tmp_path):
    # With dropout the losses depend on every random stream; they equal the uninterrupted run's
    # only if the tracker's and the CPU generator's states are restored.
    (full, resumed), *_ = run_distributed(
        4,
        _save_then_resume_worker,
        str(tmp_path / "run"),
        [(2, 2, 1), (2, 2, 1, "--no-load-rng"), (2, 2, 1, "--no-load-optim")],
        "0.1",
    )
    _assert_resumed_equal(full["losses"], *resumed[(2, 2, 1)])
    start, fresh_streams = resumed[(2, 2, 1, "--no-load-rng")]
    assert start == 2 and abs(fresh_streams[0] - full["losses"][2]) > 1e-6
    # without the optimizer state the first resumed step is the same forward (same weights, same
    # streams), the second differs (a fresh Adam takes another step)
    start, fresh_adam = resumed[(2, 2, 1, "--no-load-optim")]
    assert start == 2 and abs(fresh_adam[0] - full["losses"][2]) < 1e-12 * full["losses"][2]
    assert abs(fresh_adam[1] - full["losses"][3]) > 1e-6


def _chunked_worker(save_dir: str, chunks: tuple[str, ...]):
    """Trains 4 steps at pp 2 with two model chunks per rank (``chunks``: the interleaved or
    ZB-V's V layout) saving after step 2, then resumes that checkpoint with and without them."""
    full = checkpoint_run((1, 2, 1), *chunks, "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {
        layout: checkpoint_run(layout[:3], "--load", ckpt, *layout[3:])
        for layout in [(1, 2, 1, *chunks), (1, 2, 1), (2, 1, 1)]
    }
    return full["losses"], {k: (v["start_step"], v["losses"]) for k, v in resumed.items()}


@pytest.mark.parametrize("chunks", [("--virtual-pipeline", "2"), ("--schedule", "zb-v")])
def test_chunked_pipeline_checkpoints(saved_at_tp2_pp2, tmp_path, chunks):
    # Saved from chunk lists (2 chunks per stage, global layer names) and loaded at layouts with
    # and without them. In ZB-V's V, rank 0 holds the embedding (chunk 0) and its tied copy
    # (chunk 1): the copy is saved once and loaded into both, its optimizer state too.
    _, full, _ = saved_at_tp2_pp2
    (losses, resumed), _ = run_distributed(2, _chunked_worker, str(tmp_path / "run"), chunks)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full["losses"]), rtol=1e-9, atol=0)
    for start_and_losses in resumed.values():
        _assert_resumed_equal(full["losses"], *start_and_losses)


def _strided_worker(save_dir: str, dcp_hooks: bool):
    """Layers split with a stride (e.g. a fused QKV weight) reshard exactly: a column- and a
    row-parallel layer with stride 3 saved at TP 2 load as the serial master weights, and back
    into TP 2 shards. ``dcp_hooks``: through the DTensor-style hooks that torch before 2.14 needs,
    whatever torch runs."""
    import torch.distributed.checkpoint as dcp

    from megatron_ext import ModelParallelConfig, parallel_state, tensor_parallel
    from megatron_ext.dist_checkpointing import replicated, sharding, tp_partitioned

    if dcp_hooks:
        sharding._DCP_READS_SHARD_FIELDS = False

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    config = ModelParallelConfig(
        tensor_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float64
    )
    init = torch.nn.init.normal_
    torch.manual_seed(5)
    column = tensor_parallel.ColumnParallelLinear(
        4, 12, config=config, init_method=init, stride=3, keep_master_weight_for_test=True
    )
    row = tensor_parallel.RowParallelLinear(
        12,
        4,
        config=config,
        init_method=init,
        stride=3,
        bias=False,
        skip_bias_add=False,
        input_is_parallel=True,
        keep_master_weight_for_test=True,
    )
    rank, tp = parallel_state.get_tensor_model_parallel_rank(), 2

    def shards(layer):
        w = layer.weight
        return tp_partitioned(w.detach(), w.partition_dim, w.partition_stride, rank, tp)

    dcp.save({"column": shards(column), "row": shards(row)}, checkpoint_id=save_dir)
    full = {"column": torch.zeros(12, 4, dtype=torch.float64), "row": torch.zeros(4, 12, dtype=torch.float64)}
    dcp.load({k: replicated(v) for k, v in full.items()}, checkpoint_id=save_dir)
    torch.testing.assert_close(full["column"], column.master_weight, rtol=0, atol=0)
    torch.testing.assert_close(full["row"], row.master_weight, rtol=0, atol=0)
    back = {"column": torch.zeros_like(column.weight), "row": torch.zeros_like(row.weight)}
    dcp.load(
        {
            "column": tp_partitioned(back["column"], 0, 3, rank, tp),
            "row": tp_partitioned(back["row"], 1, 3, rank, tp),
        },
        checkpoint_id=save_dir,
    )
    torch.testing.assert_close(back["column"], column.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(back["row"], row.weight.detach(), rtol=0, atol=0)
    # the stride matters: rank 0 holds rows 0-1, 4-5, 8-9 of the column-parallel master weight
    assert rank != 0 or torch.equal(column.weight.detach()[2:4], column.master_weight[4:6])


@pytest.mark.parametrize("dcp_hooks", [False, True], ids=["fields", "hooks"])
def test_strided_partitions_reshard_exactly(tmp_path, dcp_hooks):
    run_distributed(2, _strided_worker, str(tmp_path / "strided"), dcp_hooks)


def _killed_mid_save_worker(save_dir: str):
    from megatron_ext.training import checkpointing as checkpoint

    saves = []

    def die_in_second_save():
        saves.append(1)
        if len(saves) == 2 and dist.get_rank() == 1:
            os._exit(17)  # this rank's files are written; the checkpoint is not complete yet

    with mock.patch.object(checkpoint, "_after_rank_wrote", die_in_second_save):
        checkpoint_run((1, 2, 1), "--save", save_dir, "--save-interval", "2", "--timeout", "20")


def _load_worker(path: str, layout, *extra):
    try:
        result = checkpoint_run(layout, "--load", path, *extra)
    except Exception as e:  # noqa: BLE001  (the test compares every rank's error)
        return f"{type(e).__name__}: {e}"
    return result["start_step"], result["losses"]


def test_rank_killed_mid_save_leaves_previous_checkpoint(saved_at_tp2_pp2, tmp_path):
    _, full, _ = saved_at_tp2_pp2
    save_dir = str(tmp_path / "run")
    with pytest.raises(AssertionError) as failure:
        run_distributed(2, _killed_mid_save_worker, save_dir, timeout=120)
    assert "exited with code 17" in str(failure.value)
    assert sorted(os.listdir(save_dir)) == [
        ".tmp.iter_0000004",
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
    assert any(name.endswith(".distcp") for name in os.listdir(os.path.join(save_dir, ".tmp.iter_0000004")))
    assert not os.path.exists(os.path.join(save_dir, ".tmp.iter_0000004", "checkpoint.json"))
    # the save directory resumes from iteration 2; the half-written one is refused by name
    resumed, incomplete = (
        run_distributed(2, _load_worker, path, (1, 2, 1))
        for path in (save_dir, os.path.join(save_dir, ".tmp.iter_0000004"))
    )
    _assert_resumed_equal(full["losses"], *resumed[0])
    assert incomplete[0] == incomplete[1] and "is incomplete: it has no checkpoint.json" in incomplete[0]


def _other_optimizer_worker(ckpt: str):
    train_gpt = load_train_gpt()

    build = train_gpt.get_megatron_optimizer

    def momentum_only(*args, **kwargs):  # an optimizer whose state has other keys than Adam's
        optimizer = build(*args, **kwargs)
        by_name = optimizer.param_state_by_name
        optimizer.param_state_by_name = lambda: {
            n: {"param": e["param"], "momentum_buffer": e["exp_avg"]} for n, e in by_name().items()
        }
        return optimizer

    train_gpt.get_megatron_optimizer = momentum_only
    try:
        train_gpt.train(checkpoint_args(train_gpt, 1, 2, 1, "--load", ckpt))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _refusals_worker(ckpt: str, corrupted: str, truncated: str):
    return {
        "optimizer": _other_optimizer_worker(ckpt),
        "hidden": _load_worker(ckpt, (2, 1, 1), "--hidden", "64"),
        "layers": _load_worker(ckpt, (1, 2, 1), "--layers", "2"),
        "corrupted": _load_worker(corrupted, (2, 1, 1)),
        "truncated": _load_worker(truncated, (1, 2, 1)),
    }


def test_other_model_or_corrupted_file_is_refused_on_every_rank(saved_at_tp2_pp2, tmp_path):
    import shutil

    save_dir, _, _ = saved_at_tp2_pp2
    ckpt = os.path.join(save_dir, "iter_0000002")
    corrupted, truncated = str(tmp_path / "corrupted"), str(tmp_path / "truncated")
    shutil.copytree(ckpt, corrupted)
    shutil.copytree(ckpt, truncated)
    data_file = min(n for n in os.listdir(corrupted) if n.endswith(".distcp"))
    with open(os.path.join(corrupted, data_file), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(os.path.join(truncated, ".metadata"), "r+b") as f:
        f.truncate(10)
    results = run_distributed(2, _refusals_worker, ckpt, corrupted, truncated, timeout=200)
    assert results[0] == results[1]  # the same error on every rank
    errors = results[0]
    assert all(e.startswith("CheckpointingException: cannot load checkpoint") for e in errors.values()), (
        errors
    )
    # the recorded configuration names the cause
    assert (
        "the checkpoint was saved with hidden_size=32, kv_channels=8, ffn_hidden_size=128; this model has "
        "hidden_size=64, kv_channels=16, ffn_hidden_size=256" in errors["hidden"]
    )
    assert "the checkpoint was saved with num_layers=4; this model has num_layers=2" in errors["layers"]
    assert f"file {data_file} is corrupted" in errors["corrupted"]
    assert "file .metadata is corrupted" in errors["truncated"]
    assert "the optimizer state of decoder.layers." in errors["optimizer"]
    assert (
        "holds ['exp_avg', 'exp_avg_sq', 'param'] in the checkpoint, "
        "the optimizer has ['momentum_buffer', 'param']" in errors["optimizer"]
    )


def _convert(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.training.convert", *argv],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _serial_then_resume_worker(serial_dir: str, converted: str):
    serial = checkpoint_run((1, 1, 1), "--steps", "2", "--save", serial_dir)
    resumed = checkpoint_run((1, 1, 1), "--load", converted)
    return serial["losses"], (resumed["start_step"], resumed["losses"])


def test_convert_to_one_file_and_back(saved_at_tp2_pp2, tmp_path):
    save_dir, full, _ = saved_at_tp2_pp2
    first, second = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    assert "16 model tensors, 48 optimizer tensors, iteration 2" in _convert(
        "to-torch", os.path.join(save_dir, "iter_0000002"), first
    )
    _convert("from-torch", first, str(tmp_path / "converted"))
    _convert("to-torch", str(tmp_path / "converted"), second)
    a, b = (torch.load(p, weights_only=False) for p in (first, second))
    assert a["checkpoint"]["iteration"] == 2 and a["common"]["optimizer"]["step"] == 2
    rng = [f"rng_state/shard_{pp}.{tp}.0_2.2.1" for pp in (0, 1) for tp in (0, 1)]
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    extra_state = [f"decoder.layers.{name}._extra_state/shard_{i}_4" for name in linears for i in range(4)]
    assert sorted(a["objects"]) == sorted(rng + extra_state)
    assert all(a["objects"][k] == [None] for k in extra_state)
    assert b["checkpoint"] == a["checkpoint"] and b["common"] == a["common"]
    assert sorted(b["objects"]) == sorted(a["objects"])
    assert all(torch.equal(b["objects"][k][0]["cpu"], a["objects"][k][0]["cpu"]) for k in rng)
    torch.testing.assert_close(
        (b["model"], b["optimizer"]), (a["model"], a["optimizer"]), rtol=0, atol=0
    )  # exact
    # Megatron-core's keys and global shapes: the tied output weight is the embedding, the layers
    # are stacked along a leading axis of 4
    assert a["model"]["embedding.word_embeddings.weight"].shape == (256, 32)
    assert a["model"]["decoder.layers.self_attention.linear_qkv.weight"].shape == (4, 96, 32)
    assert "output_layer.weight" not in a["model"]
    assert sorted(a["optimizer"]) == sorted(
        f"optimizer.state.{k}.{key}" for key in a["model"] for k in ("exp_avg", "exp_avg_sq", "param")
    )
    # the one-file tensors are the serial model's after the same two steps; the converted
    # checkpoint resumes the uninterrupted run
    ((serial_losses, resumed),) = run_distributed(
        1, _serial_then_resume_worker, str(tmp_path / "serial"), str(tmp_path / "converted")
    )
    torch.testing.assert_close(
        torch.tensor(serial_losses), torch.tensor(full["losses"][:2]), rtol=1e-9, atol=0
    )
    _assert_resumed_equal(full["losses"], *resumed)
    _convert("to-torch", str(tmp_path / "serial"), str(tmp_path / "serial.pt"))
    serial = torch.load(str(tmp_path / "serial.pt"), weights_only=False)
    assert sorted(serial["model"]) == sorted(a["model"])
    for group in ("model", "optimizer"):
        torch.testing.assert_close(serial[group], a[group], rtol=1e-9, atol=1e-12)


def _format_1_worker(save_dir: str, old: str):
    """Trains 2 serial steps and saves; at that save also writes the same state in the earlier
    format (FORMAT_1) as its save did: DCP entries by megatron_ext's names, one tensor per layer."""
    import io

    import torch.distributed.checkpoint as dcp

    from megatron_ext.training import checkpointing as checkpoint

    train_gpt = load_train_gpt()
    save_checkpoint = train_gpt.save_checkpoint

    def blob(obj) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    def save_both(save_dir, iteration, model, optimizer, **kwargs):
        final = save_checkpoint(save_dir, iteration, model, optimizer, **kwargs)
        chunk = model[0] if isinstance(model, list) else model  # one chunk (DDP-wrapped)
        bare = lambda name: name.removeprefix("module.")  # noqa: E731
        state = {
            "model": {bare(n): p.detach() for n, p in chunk.named_parameters()},
            "optimizer": {
                "step": int(optimizer.state_dict()["step"]),
                "param_state": {bare(n): e for n, e in optimizer.param_state_by_name().items()},
            },
            "rng": {"tp0_pp0_dp0": blob(checkpoint._rng_states())},
        }
        dcp.save(state, checkpoint_id=old)
        with open(os.path.join(final, "checkpoint.json")) as f:
            marker = json.load(f)
        files = {n: checkpoint._sha256(os.path.join(old, n)) for n in sorted(os.listdir(old))}
        with open(os.path.join(old, "checkpoint.json"), "w") as f:
            json.dump({**marker, "format": checkpoint.FORMAT_1, "files": files}, f)
        return final

    train_gpt.save_checkpoint = save_both
    train_gpt.train(checkpoint_args(train_gpt, 1, 1, 1, "--steps", "2", "--save", save_dir))
    return _load_worker(old, (1, 1, 1))


def test_upgrade_of_a_format_1_checkpoint(tmp_path):
    # A checkpoint of the earlier format is refused by name, and `convert upgrade` rewrites it as
    # exactly the checkpoint today's save writes of the same state.
    save_dir, old, new = str(tmp_path / "run"), str(tmp_path / "old"), str(tmp_path / "new")
    (refused,) = run_distributed(1, _format_1_worker, save_dir, old)
    assert refused.startswith(f"CheckpointingException: cannot load checkpoint {old!r}: checkpoint {old!r}: "
                              "format 'megatron_ext.dist_checkpointing/1', expected "
                              "'megatron_ext.dist_checkpointing/2'"), refused
    assert f"megatron_ext.training.convert upgrade {old} NEW_DIR" in refused
    assert _convert("upgrade", old, new) == f"{new}: written\n"
    first, second = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    _convert("to-torch", os.path.join(save_dir, "iter_0000002"), first)
    _convert("to-torch", new, second)
    a, b = (torch.load(p, weights_only=False) for p in (first, second))
    assert b["checkpoint"] == a["checkpoint"] and b["common"] == a["common"] == {"optimizer": {"step": 2}}
    assert sorted(b["model"]) == sorted(a["model"]) and len(a["model"]) == 16
    assert sorted(b["optimizer"]) == sorted(a["optimizer"]) and sorted(b["objects"]) == sorted(a["objects"])
    # every tensor and RNG state, exactly
    torch.testing.assert_close((b["model"], b["optimizer"]), (a["model"], a["optimizer"]), rtol=0, atol=0)
    for key, value in a["objects"].items():
        if key.startswith("rng_state/"):
            torch.testing.assert_close(b["objects"][key], value, rtol=0, atol=0)
        else:
            assert b["objects"][key] == value == [None], key


def _distributed_optimizer_worker(save_dir: str):
    dist_opt = "--use-distributed-optimizer"
    full = checkpoint_run((2, 1, 2), dist_opt, "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {
        layout: checkpoint_run(layout[:3], "--load", ckpt, *layout[3:])
        for layout in [(2, 1, 2, dist_opt), (1, 2, 2, dist_opt), (1, 1, 4, dist_opt), (1, 4, 1)]
    }
    return full["losses"], {k: (v["start_step"], v["losses"]) for k, v in resumed.items()}


def test_distributed_optimizer_state_reshards(saved_at_tp2_pp2, tmp_path):
    # The Adam state sharded over dp 2 is stored gathered (per TP shard) and re-sliced over dp 4,
    # or loaded into the plain optimizer at dp 1.
    _, full, _ = saved_at_tp2_pp2
    (losses, resumed), *_ = run_distributed(4, _distributed_optimizer_worker, str(tmp_path / "run"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full["losses"]), rtol=1e-9, atol=0)
    for start_and_losses in resumed.values():
        _assert_resumed_equal(full["losses"], *start_and_losses)


def _context_parallel_worker(save_dir: str):
    """Trains 4 steps at cp 2 x dp 2 with the distributed optimizer (its state sharded over the 4
    ranks of dp x cp) saving after step 2, then resumes at cp 1, cp 4 and cp 2 x tp 2."""
    dist_opt = "--use-distributed-optimizer"
    full = checkpoint_run((1, 1, 2), "--cp", "2", dist_opt, "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {
        layout: checkpoint_run(layout[:3], "--load", ckpt, *layout[3:])
        for layout in [
            (1, 1, 2, "--cp", "2", dist_opt),  # the saving layout: its RNG states are restored
            (1, 1, 4, dist_opt),
            (1, 1, 1, "--cp", "4"),
            (2, 1, 1, "--cp", "2", dist_opt),
        ]
    }
    return full["losses"], {k: (v["start_step"], v["losses"]) for k, v in resumed.items()}


def test_resume_across_context_parallel_sizes(saved_at_tp2_pp2, tmp_path):
    # The cp ranks of a checkpoint are replicas, so it loads at any cp size; the run at cp 2 and
    # every resumed run compute the uninterrupted tp 2 x pp 2 run's losses.
    _, full, _ = saved_at_tp2_pp2
    (losses, resumed), *_ = run_distributed(4, _context_parallel_worker, str(tmp_path / "run"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full["losses"]), rtol=1e-9, atol=0)
    assert len(resumed) == 4
    for start_and_losses in resumed.values():
        _assert_resumed_equal(full["losses"], *start_and_losses)
    with open(os.path.join(tmp_path, "run", "iter_0000002", "checkpoint.json")) as f:
        assert json.load(f)["layout"] == {"tp": 1, "pp": 1, "dp": 2, "cp": 2, "vpp": 1}


def _mixed_precision_worker(save_dir: str, precision: str):
    # --dtype float64 of CHECKPOINT_STEPS is replaced: 16-bit parameters, float32 main parameters.
    def run(layout, *extra):
        train_gpt = load_train_gpt()
        args = train_gpt.parse_args(SMALL + ["--steps", "4", precision, "--use-distributed-optimizer",
                                             "--tp", str(layout[0]), "--pp", str(layout[1]),
                                             "--dp", str(layout[2]), *extra])
        return train_gpt.train(args)

    full = run((2, 1, 2), "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    same = run((2, 1, 2), "--load", ckpt)
    other = run((1, 2, 2), "--load", ckpt)
    return full["losses"], (same["start_step"], same["losses"]), (other["start_step"], other["losses"])


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_resume(tmp_path, precision):
    # The float32 main parameters, Adam state and (fp16) loss scale come back: at the saving layout
    # the resumed 16-bit run repeats the uninterrupted one bit for bit; at another layout it differs
    # only by 16-bit rounding in another reduction order.
    (full, same, other), *_ = run_distributed(4, _mixed_precision_worker, str(tmp_path / "run"), precision)
    assert same == (2, full[2:])
    assert other[0] == 2
    torch.testing.assert_close(torch.tensor(other[1]), torch.tensor(full[2:]), rtol=2e-2, atol=0)
