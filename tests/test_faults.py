"""Faults a long run meets: a --load that names nothing, a save into a directory with newer
checkpoints, a full disk, a re-saved iteration, a checkpoint of another model, a killed worker
under torchrun. Each is refused or survived, with the same error on every rank."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT, SMALL, command_lines_end_in_one_error_line, load_train_gpt
from tests.distributed import free_port, run_distributed

pytestmark = pytest.mark.slow  # kills, stops and restarts training runs

TINY = SMALL + ["--layers", "2", "--dtype", "float64", "--tp", "1", "--pp", "2"]
TRACKER = "latest_checkpointed_iteration.txt"


def _fake_checkpoint(save_dir: pathlib.Path, iteration: int, track: bool = True) -> None:
    from megatron_ext.training.checkpointing import FORMAT

    directory = save_dir / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    (directory / "checkpoint.json").write_text(json.dumps({"format": FORMAT, "iteration": iteration}))
    if track:
        (save_dir / TRACKER).write_text(f"{iteration}\n")


def test_checkpoint_paths_and_arguments_are_checked_before_the_process_group(tmp_path):
    train_gpt = load_train_gpt()
    saves = tmp_path / "saves"  # holds iterations 10 and 20, the tracker names 20
    _fake_checkpoint(saves, 10)
    _fake_checkpoint(saves, 20)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    missing, empty, file = str(tmp_path / "missing"), str(tmp_path / "empty"), str(tmp_path / "file")

    def check(*argv: str) -> None:
        train_gpt.check_args(train_gpt.parse_args(TINY + list(argv)), 2)

    refused = {
        (
            "--load",
            missing,
        ): f"--load {missing!r} does not exist; to train from scratch, name it as --save too",
        ("--load", file): f"--load {file!r} is not a directory; expected a checkpoint or a --save directory",
        (
            "--load",
            empty,
        ): f"--load {empty!r} holds no checkpoint; to train from scratch, name it as --save too "
        "(a run that resumes from its own saves) or pass --allow-fresh-start",
        ("--load", missing, "--allow-fresh-start"): "does not exist",
        (
            "--save",
            str(saves),
        ): f"--save {str(saves)!r} holds iteration 20, newer than the iteration 0 this run "
        f"starts from: its saves would overwrite newer checkpoints. Resume them with "
        f"--load {saves}, choose another --save directory, or pass --allow-overwrite",
        ("--load", str(saves / "iter_0000010"), "--save", str(saves)): "holds iteration 20, newer than the "
        "iteration 10",
        ("--weight-decay", "-0.1"): "--weight-decay must be a finite number in [0, 3.40282e+38], got -0.1",
        ("--data", empty): f"--data {empty!r} is a directory; expected a text file",
        ("--keep-last", "0", "--save", empty): "--keep-last 0 needs --save and must be >= 1",
        ("--keep-last", "2"): "--keep-last 2 needs --save and must be >= 1",
    }
    for argv, message in refused.items():
        with pytest.raises(ValueError) as error:
            check(*argv)
        assert message in str(error.value), (argv, str(error.value))
    # allowed: the restart case (--load is --save, empty or not there yet), the explicit flag,
    # resuming the newest, overwriting when asked
    for argv in (
        ("--load", empty, "--save", empty),
        ("--load", missing, "--save", missing),
        ("--load", empty, "--allow-fresh-start"),
        ("--load", str(saves), "--save", str(saves)),
        ("--save", str(saves), "--allow-overwrite"),
    ):
        check(*argv)
    # a tracker that names no iteration
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / TRACKER).write_text("latest\n")
    with pytest.raises(RuntimeError, match="expected an iteration number, found 'latest'"):
        check("--load", str(tmp_path / "bad"))

    # From the command line: one error: line, exit 2, and no process group (no torchrun here). With
    # WORLD_SIZE 4 and no rendezvous variables, a process group started first would fail otherwise.
    bad = str(tmp_path / "bad")
    train = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--tp", "1", "--pp", "1"]
    command_lines_end_in_one_error_line([
        ([*train, *argv], {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(world)}, message)
        for argv, world, message in ((["--load", missing], 1, f"error: --load {missing!r} does not exist"),
                                     (["--load", bad], 1, "error: " + os.path.join(bad, TRACKER)),
                                     (["--tp", "2", "--pp", "2", "--heads", "3"], 4,
                                      "error: --heads 3 is not divisible by --tp 2"))
    ])

    # the smaller messages
    corpus = tmp_path / "short.txt"
    corpus.write_bytes(b"0123456789")
    with pytest.raises(
        ValueError, match=r"the corpus has 10 bytes; at least 18 are needed \(--seq-len \+ 2\)"
    ):
        train_gpt.load_corpus(str(corpus), 16 + 2)
    args = train_gpt.parse_args(TINY + ["--steps", "1"])
    one_step = {"losses": [5.5], "tokens_per_s": [123.4], "start_step": 0}
    assert train_gpt.summary(one_step, args) == "loss 5.5000 -> 5.5000 over steps 1-1, 123 tokens/s"


def _run(*argv: str) -> dict:
    train_gpt = load_train_gpt()
    return train_gpt.train(train_gpt.parse_args(TINY + list(argv)))


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001  (the test compares every rank's error)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _listing(save_dir: str) -> list[str]:
    names = sorted(os.listdir(save_dir))
    with open(os.path.join(save_dir, TRACKER)) as f:
        return names + [f"tracker {f.read().strip()}"]


def _save_guards_worker(save_dir: str) -> dict:
    from megatron_ext.training import checkpointing as checkpoint
    from megatron_ext.dist_checkpointing import serialization
    from megatron_ext.dist_checkpointing.strategies import filesystem_async

    out = {}
    first = _run("--steps", "4", "--save", save_dir, "--save-interval", "1", "--keep-last", "2")
    out["pruned"] = _listing(save_dir)
    dist.barrier()
    # a fresh run into the same directory: refused before training, then by the save itself
    out["fresh"] = _error(_run, "--steps", "2", "--save", save_dir)
    from megatron_ext.training import validation

    train_gpt, check_checkpoint_paths = load_train_gpt(), validation.check_checkpoint_paths
    validation.check_checkpoint_paths = lambda args: None
    try:
        out["library"] = _error(
            train_gpt.train, train_gpt.parse_args(TINY + ["--steps", "2", "--save", save_dir])
        )
    finally:
        validation.check_checkpoint_paths = check_checkpoint_paths
    out["after_refusals"] = _listing(save_dir)
    dist.barrier()

    # a full disk while rank 1 writes its files of iteration 5, then while rank 0 completes it. The
    # writes go to /dev/full, whose every write fails with ENOSPC, through torch's own zip writer
    # (which turns that into "unexpected pos ..."); each file is made, partly written, at its path.
    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk_open(path, mode="r", *args, **kwargs):
        if "w" not in mode:
            return open(path, mode, *args, **kwargs)
        with open(path, "wb") as partial:
            partial.write(b"partial")
        return open("/dev/full", mode, buffering=0 if "b" in mode else -1)

    resume = ("--steps", "5", "--load", save_dir, "--save", save_dir)
    if dist.get_rank() == 1:
        filesystem_async.open = full_disk_open
    out["disk_full_write"] = _error(_run, *resume)
    vars(filesystem_async).pop("open", None)
    out["after_disk_full_write"] = _listing(save_dir)
    dist.barrier()
    if dist.get_rank() == 0:  # rank 0's common.pt, written by torch.save
        serialization.open = full_disk_open
    out["disk_full_common"] = _error(_run, *resume)
    vars(serialization).pop("open", None)
    out["after_disk_full_common"] = _listing(save_dir)
    dist.barrier()
    if dist.get_rank() == 0:  # rank 0's metadata.json, after every rank wrote its files
        serialization.open = lambda path, mode="r", *args, **kwargs: (
            full_disk_open if path.endswith("metadata.json") else open)(path, mode, *args, **kwargs)
    out["disk_full_metadata"] = _error(_run, *resume)
    vars(serialization).pop("open", None)
    out["after_disk_full_metadata"] = _listing(save_dir)
    dist.barrier()
    fsync_dir = checkpoint._fsync_dir
    if dist.get_rank() == 0:
        checkpoint._fsync_dir = no_space
    out["disk_full_commit"] = _error(_run, *resume)
    checkpoint._fsync_dir = fsync_dir
    out["after_disk_full_commit"] = _listing(save_dir)
    dist.barrier()

    # the same run with room: resumes from 4, saves 5
    resumed = _run(*resume, "--keep-last", "2")
    out["resumed"] = (resumed["start_step"], resumed["losses"])
    out["after_resume"] = _listing(save_dir)
    dist.barrier()
    # re-saving the iteration the tracker names (asked for): the directories are swapped
    again = _run("--steps", "5", "--load", os.path.join(save_dir, "iter_0000004"), "--save", save_dir,
                 "--allow-overwrite", "--keep-last", "1")
    out["again"] = (again["start_step"], again["losses"])
    out["after_again"] = _listing(save_dir)
    dist.barrier()
    # moving the tracker back (asked for): the newest and the tracked iteration both stay
    _run("--steps", "1", "--save", save_dir, "--allow-overwrite", "--keep-last", "1")
    out["after_back"] = _listing(save_dir)
    out["first"] = first["losses"]
    return out


def test_save_guards_full_disk_and_pruning(tmp_path):
    save_dir = str(tmp_path / "run")
    results = run_distributed(2, _save_guards_worker, save_dir, timeout=240)
    assert results[0] == results[1]  # the same errors on every rank
    out = results[0]
    tracked = ["iter_0000003", "iter_0000004", TRACKER]
    assert out["pruned"] == tracked + ["tracker 4"]  # --keep-last 2 after saves 1-4
    assert "holds iteration 4, newer than the iteration 0 this run starts from" in out["fresh"]
    assert out["library"] == (
        f"CheckpointingException: cannot save checkpoint {os.path.join(save_dir, 'iter_0000002')!r}: "
        f"{save_dir!r} already holds iteration 4, newer than 2; saving would overwrite newer checkpoints and "
        "move the tracker back (overwrite=True allows it)"
    )
    for key in ("after_refusals", "after_disk_full_write", "after_disk_full_common",
                "after_disk_full_metadata", "after_disk_full_commit"):
        assert out[key] == tracked + ["tracker 4"], key  # nothing half-written is left
    tmp = os.path.join(save_dir, ".tmp.iter_0000005")
    no_space = "[Errno 28] No space left on device"
    for key, where in (("disk_full_write", f"rank 1: RuntimeError: Worker failure: {no_space}"),
                       ("disk_full_common", f"OSError: {no_space}"),
                       ("disk_full_metadata", f"OSError: {no_space}"),
                       ("disk_full_commit", f"OSError: {no_space}")):
        assert "unexpected pos" not in out[key], out[key]
        assert out[key].startswith(
            f"CheckpointingException: cannot save checkpoint {os.path.join(save_dir, 'iter_0000005')!r}: "
        ), out[key]
        assert (
            where in out[key] and f"(removed {tmp!r}; iteration 4 is still the newest checkpoint)" in out[key]
        ), out[key]
    start, losses = out["resumed"]
    assert start == 4 and len(losses) == 1
    assert out["after_resume"] == ["iter_0000004", "iter_0000005", TRACKER, "tracker 5"]
    assert out["again"] == out["resumed"]  # the same step from the same state, bit for bit
    assert out["after_again"] == ["iter_0000005", TRACKER, "tracker 5"]
    assert out["after_back"] == ["iter_0000001", "iter_0000005", TRACKER, "tracker 1"]
    assert len(out["first"]) == 4 and out["first"][-1] < out["first"][0]


def test_resaving_the_tracked_iteration_never_leaves_it_missing(tmp_path, monkeypatch):
    # The old directory is removed only after the new one is in place: a process killed at that
    # moment (here: the removal fails) leaves the new checkpoint where the tracker points.
    from megatron_ext.training import checkpointing as checkpoint

    old, new = tmp_path / "iter_0000005", tmp_path / ".tmp.iter_0000005"
    old.mkdir()
    (old / "checkpoint.json").write_text("old")
    new.mkdir()
    (new / "checkpoint.json").write_text("new")

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt(path)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._replace_dir(str(new), str(old))
    assert (old / "checkpoint.json").read_text() == "new"
    assert (new / "checkpoint.json").read_text() == "old"  # what the next save removes


def _other_model_worker(save_dir: str) -> dict:
    full = _run("--steps", "4", "--heads", "2", "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    float32 = _run("--steps", "4", "--heads", "2", "--load", ckpt, "--dtype", "float32")
    return {
        "full": full["losses"],
        "heads": _error(_run, "--steps", "4", "--heads", "4", "--load", ckpt),
        "float32": (float32["start_step"], float32["losses"]),
    }


def test_checkpoint_of_another_model_is_refused_naming_the_field(tmp_path):
    results = run_distributed(2, _other_model_worker, str(tmp_path / "run"))
    assert results[0] == results[1]
    out = results[0]
    # same shapes, other heads: the query/key/value rows would be split differently
    assert out["heads"] == (
        f"CheckpointingException: cannot load checkpoint {str(tmp_path / 'run' / 'iter_0000002')!r}: the "
        "checkpoint was saved with num_attention_heads=2, num_query_groups=2, kv_channels=16; this model has "
        "num_attention_heads=4, num_query_groups=4, kv_channels=8"
    )
    # another parameter dtype is allowed: the values are converted
    start, losses = out["float32"]
    assert start == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(out["full"][2:]), rtol=1e-5, atol=0)
    with open(tmp_path / "run" / "iter_0000002" / "checkpoint.json") as f:
        config = json.load(f)["model_config"]
    assert config == {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_query_groups": 2,
        "kv_channels": 16,
        "ffn_hidden_size": 128,
        "vocab_size": 256,
        "max_sequence_length": 16,
        "normalization": "LayerNorm",
        "activation": "gelu",
        "gated_linear_unit": False,
        "add_bias_linear": True,
        "qk_layernorm": False,
        "rotary_interleaved": False,
        "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": True,
        "params_dtype": "float64",
    }


def _reference_worker() -> list[float]:
    return _run("--steps", "8")["losses"]


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    (losses, _) = run_distributed(2, _reference_worker)
    return losses


@pytest.mark.parametrize("nnodes", [1, 2])
def test_torchrun_restarts_killed_workers_from_the_latest_checkpoint(tmp_path, uninterrupted, nnodes):
    # Plain torchrun --max-restarts, no environment variable: in the first attempt rank 1 is
    # SIGKILLed at step 6 (after the save of iteration 4); on one node, in the second attempt rank 0
    # is SIGKILLed during the save of iteration 6. Each restarted group resumes from iteration 4
    # and steps 5-8 equal the uninterrupted run's (float64). nnodes 2: two launchers, one
    # process each, c10d rendezvous.
    save_dir, log = str(tmp_path / "run"), str(tmp_path / "log.jsonl")
    kills = {"KILL_AT_STEP": "0,1,5"} if nnodes == 2 else {"KILL_AT_STEP": "0,1,5", "KILL_IN_SAVE": "1,0"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", str(len(kills)),
                "--monitor-interval", "0.1"]
    if nnodes == 1:
        launchers = [launcher + ["--standalone", "--nproc-per-node", "2"]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        launchers = [launcher + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", endpoint, "--rdzv-id", "faults"]] * 2
    script = [str(ROOT / "tests" / "elastic_train_gpt.py"), *TINY, "--steps", "8", "--save", save_dir,
              "--load", save_dir, "--save-interval", "2", "--log-json", log, "--timeout", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kills}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    procs = [
        subprocess.Popen(cmd + script, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in launchers
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    stdout, stderr = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
    assert all(p.returncode == 0 for p in procs), stdout[-3000:] + stderr[-3000:]
    assert "no checkpoint in" in stdout and stdout.count("resumed from iteration 4") == len(kills)
    assert stderr.count("exitcode: -9") == len(kills)  # the kills happened
    records = [json.loads(line) for line in open(log)]
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    assert [records[i]["resumed_from"] for i in starts] == [0] + [4] * len(kills)
    assert [records[i]["attempt"] for i in starts][0] == 0
    attempts = [records[i:j] for i, j in zip(starts, starts[1:] + [len(records)])]
    steps = [{r["step"]: r["loss"] for r in attempt if "step" in r} for attempt in attempts]
    assert sorted(steps[0]) == [1, 2, 3, 4, 5] and sorted(steps[-1]) == [5, 6, 7, 8]
    if nnodes == 1:
        assert sorted(steps[1]) == [5, 6]  # killed in the save of 6, which never completed
    saves = [[r["iteration"] for r in attempt if r.get("event") == "save"] for attempt in attempts]
    assert saves[0] == [2, 4] and saves[-1] == [6, 8]
    for attempt in steps:
        torch.testing.assert_close(torch.tensor(list(attempt.values())),
                                   torch.tensor([uninterrupted[s - 1] for s in attempt]), rtol=1e-12, atol=0)
    assert sorted(os.listdir(save_dir)) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000006",
        "iter_0000008",
        TRACKER,
    ]


def _nonfinite_worker(save_dir: str) -> dict:
    """Rank 1's loss is made NaN in step 3 (or, for "grad", rank 1's gradients after the
    data-parallel reduction, inside the fp16 optimizer's step after its tenth update)."""

    def run(layout: tuple[int, int, int], *argv: str, poison: str = "loss") -> dict:
        train_gpt = load_train_gpt()
        steps = []
        if dist.get_rank() == 1 and poison == "loss":
            step_microbatches, forward_step = train_gpt.step_microbatches, train_gpt.forward_step

            def note_step(corpus, step, args, device):
                steps.append(step)
                return step_microbatches(corpus, step, args, device)

            def nan_in_step_3(data_iterator, model):
                output, loss_func = forward_step(data_iterator, model)

                def poisoned(output):
                    loss, report = loss_func(output)
                    return (loss * float("nan"), {"lm loss": loss.detach() * float("nan")}) \
                        if steps[-1] == 2 else (loss, report)

                return output, poisoned

            train_gpt.step_microbatches, train_gpt.forward_step = note_step, nan_in_step_3
        optimizers, injected = [], []
        build = train_gpt.get_megatron_optimizer

        def keep(*a, **k):
            optimizer = build(*a, **k)
            optimizers.append(optimizer)
            copy = optimizer._copy_model_grads_to_main_grads

            def nan_after_ten_updates():  # where the loss scale has settled: no overflow of its own
                copy()
                if poison == "grad" and dist.get_rank() == 1 and optimizer._steps >= 10 and not injected:
                    next(s for s in optimizer._slots if s.main.grad is not None).main.grad.fill_(float("nan"))
                    injected.append(1)

            optimizer._copy_model_grads_to_main_grads = nan_after_ten_updates
            return optimizer

        train_gpt.get_megatron_optimizer = keep
        tp, pp, dp = layout
        args = train_gpt.parse_args(
            SMALL + ["--layers", "2", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), *argv]
        )
        try:
            result = train_gpt.train(args)
        except FloatingPointError as e:
            return {"error": str(e)}
        params = sum(float(p.double().sum()) for p in optimizers[0].get_parameters())
        return {"losses": result["losses"], "skipped": result["skipped_steps"], "params": params,
                "injected": len(injected)}

    return {
        "float32": run((1, 1, 2), "--save", save_dir, "--save-interval", "1",
                       "--log-json", save_dir + "_unclipped.jsonl"),
        "bf16_dp1": run((1, 2, 1), "--bf16"),
        "skip": run((1, 1, 2), "--skip-nonfinite", "--clip-grad", "1.0", "--log-json", save_dir + ".jsonl"),
        "fp16": run((1, 1, 2), "--fp16", "--steps", "40", poison="grad"),
    }


def test_nonfinite_loss_stops_or_skips_on_every_rank(tmp_path):
    save_dir = tmp_path / "run"
    results = run_distributed(2, _nonfinite_worker, str(save_dir))
    for key in ("float32", "bf16_dp1"):
        assert results[0][key] == results[1][key], key
        assert results[0][key]["error"].startswith("step 3: non-finite loss on rank 1"), results[0][key]
        assert "stopped before the update, so no checkpoint holds it" in results[0][key]["error"]
    # the rank-1 loss made the reduced gradients non-finite on both data-parallel ranks
    assert "and non-finite gradients on ranks 0, 1" in results[0]["float32"]["error"]
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", "iter_0000002", TRACKER]  # nothing of step 3
    skip = [r["skip"] for r in results]
    assert skip[0]["skipped"] == skip[1]["skipped"] == 1 and skip[0]["params"] == skip[1]["params"]
    losses = torch.tensor(skip[0]["losses"])
    assert losses[2].isnan() and losses[[0, 1, 3, 4]].isfinite().all()
    assert losses[4] < losses[0] and torch.isfinite(torch.tensor(skip[0]["params"]))
    # the log is strict JSON: the NaN loss and the norm of the skipped step are null; without
    # --clip-grad the norm is still computed and logged
    expected = {"": ([False, False, True, False, False], [False, False, True, False, False]),
                "_unclipped": ([False, False], [False, False])}
    for log, (losses_null, norms_null) in expected.items():
        with open(f"{save_dir}{log}.jsonl") as f:
            records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the log"))
                       for line in f]
        steps = [r for r in records if "step" in r]
        assert [r["loss"] is None for r in steps] == losses_null, log
        assert [r["grad_norm"] is None for r in steps] == norms_null, log
        assert all(r["grad_norm"] > 0 for r in steps if r["grad_norm"] is not None)
    # fp16, plain optimizer: a NaN in one data-parallel copy's gradients skips the step on both
    # (reduced over the model-parallel group only, rank 1 skipped 19 steps and rank 0 18, and their
    # parameters differed)
    fp16 = [r["fp16"] for r in results]
    assert fp16[0]["injected"] == 0 and fp16[1]["injected"] == 1
    assert fp16[0]["skipped"] == fp16[1]["skipped"] < 40 and fp16[0]["params"] == fp16[1]["params"]


def _largest_layout_worker(precisions: list[list[str]]) -> list[list[float]]:
    train_gpt = load_train_gpt()
    everything = ["--tp", "2", "--pp", "2", "--dp", "2", "--virtual-pipeline", "2", "--sequence-parallel",
                  "--use-distributed-optimizer", "--overlap-param-gather", "--steps", "20", "--timeout", "60"]
    return [train_gpt.train(train_gpt.parse_args(SMALL + everything + p))["losses"] for p in precisions]


def _serial_worker() -> list[float]:
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "1", "--steps", "20", "--dtype", "float64"])
    return train_gpt.train(args)["losses"]


def test_largest_layout_runs_under_load():
    # 8 processes on the CI machine's 2 cores: tp 2 x pp 2 x dp 2, interleaved schedule, sequence
    # parallelism, distributed optimizer with overlapped parameter gathers; 20 steps in bf16 and in
    # float64 without a timeout, the float64 losses equal to the serial run's.
    (serial,) = run_distributed(1, _serial_worker)
    results = run_distributed(8, _largest_layout_worker, [["--bf16"], ["--dtype", "float64"]], timeout=400)
    assert all(r == results[0] for r in results)
    bf16, float64 = results[0]
    torch.testing.assert_close(torch.tensor(float64), torch.tensor(serial), rtol=1e-9, atol=0)
    # bf16 trains the same model: it follows the float64 curve within bf16's drift over 20 steps
    assert len(bf16) == 20 and bf16[-1] < bf16[0] - 1.0
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(serial), rtol=1e-1, atol=0)


# A rank that dies or stops: the others say where they waited -------------------------------------

FAULT_TIMEOUT = 5.0  # seconds: every process group's timeout in these runs
FAULT_LAYOUTS = {"tensor": ["--tp", "2", "--pp", "1"], "pipeline": ["--tp", "1", "--pp", "2"],
                 "data": ["--tp", "1", "--pp", "1"]}


def _faulty_rank(rank: int, port: int, layout: str, signal_name: str, marks: str, results) -> None:
    """Trains 3 steps on 2 ranks; rank 1 sends itself ``signal_name`` as step 2 begins, rank 0
    reports the error it meets and when."""
    import signal
    import time
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=FAULT_TIMEOUT))
    train_gpt = load_train_gpt()
    if rank == 1:
        step_microbatches = train_gpt.step_microbatches

        def signalled_at_step_2(corpus, step, args, device):
            if step == 1:
                pathlib.Path(marks, "signalled").write_text(repr(time.time()))
                os.kill(os.getpid(), getattr(signal, signal_name))
            return step_microbatches(corpus, step, args, device)

        train_gpt.step_microbatches = signalled_at_step_2
    args = train_gpt.parse_args(SMALL + ["--layers", "2", "--dtype", "float64", "--steps", "3",
                                         "--timeout", str(FAULT_TIMEOUT), *FAULT_LAYOUTS[layout]])
    try:
        train_gpt.train(args)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001  (reported to the test)
        outcome = f"{type(e).__name__}: {e}"
    results.put((rank, outcome, time.time()))
    results.close()
    results.join_thread()
    os._exit(0)  # the group is broken: no teardown that could wait on rank 1


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("layout", ["tensor", "pipeline", "data"])
def test_a_dead_or_stopped_rank_is_reported_with_the_collective_group_and_peer(tmp_path, layout, signal_name):
    # Rank 1 is killed (its sockets close) or stopped (they stay open) as step 2 begins. Rank 0
    # fails in the collective or exchange it waits in: at once for a killed rank, after the
    # groups' timeout for a stopped one, naming the operation, the group with its ranks and rank 1.
    import re

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_faulty_rank, args=(r, port, layout, signal_name, str(tmp_path), results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, outcome, failed_at = results.get(timeout=180)
    finally:
        procs[1].kill()  # SIGKILL ends a stopped process too
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert rank == 0, outcome
    waited = failed_at - float((tmp_path / "signalled").read_text())
    where = {
        "tensor": r"(all-reduce|all-gather|reduce-scatter) in the (forward|backward) of \w+ of a float64 "
                  r"tensor of shape \[[\d, ]+\] over the tensor-model-parallel group",
        "pipeline": r"receive from pipeline rank 1 \(the gradient of micro-batch \d, model chunk 0\) of a "
                    r"float64 tensor of shape \[16, 2, 32\] over the pipeline-model-parallel group",
        "data": r"all-reduce of the gradients of bucket \d+ \(\d+ parameters?, .*\) of a float64 tensor of "
                r"shape \[\d+\] over the data-parallel(-with-cp)? group",
    }[layout]
    message = rf"^DistBackendError: {where} \(global ranks \[0, 1\], gloo\) failed on global rank 0, " \
              r"waiting for global rank 1: "
    assert re.match(message, outcome), outcome
    if signal_name == "SIGKILL":
        assert "Connection closed by peer" in outcome or "Connection reset by peer" in outcome, outcome
        assert waited < FAULT_TIMEOUT, waited
    else:
        assert "Timed out" in outcome, outcome
        assert FAULT_TIMEOUT - 0.5 < waited < FAULT_TIMEOUT + 10, waited
