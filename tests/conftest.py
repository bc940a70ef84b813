"""The helpers the test files share, each defined here once (``from tests.conftest import ...``).

``tests/distributed.py`` runs a function on several gloo ranks; ``tests/config_checks.py`` holds
the checks run on Megatron-core's config objects and on duck-typed ones.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

# float64 tolerances. EXACT: the parallel and the serial computation add the same terms, up to a
# few roundings. TIGHT: the sums are split differently (tensor-parallel partial sums, chunked
# reductions): the project's 1e-10 relative.
EXACT = dict(rtol=1e-12, atol=1e-12)
TIGHT = dict(rtol=1e-10, atol=1e-12)

# A small GPT for examples/train_gpt.py; a test adds the layout, the dtype and what it checks.
SMALL_GPT = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--lr", "1e-2", "--no-progress", "--plot", ""]
# The same for five steps.
SMALL = SMALL_GPT + ["--steps", "5"]


def load_train_gpt() -> types.ModuleType:
    """A fresh copy of the training program's loop, ``megatron_ext.training.training``, as a module:
    a test may replace what it calls (``build_model``, ``step_microbatches``, ``parallel_state``,
    ``get_megatron_optimizer``, ...) without the change reaching the next test in the process."""
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "megatron_ext/training/training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_first_batches(argv: list[str]) -> list[dict]:
    """The micro-batches of examples/train_gpt.py's first global batch (byte corpus, one rank) for
    the command line ``argv``: what a Hugging Face model's loss is compared on."""
    import torch.distributed as dist

    from megatron_ext import parallel_state as ps

    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(argv)
    args.vocab_size = 256
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1)
        batches = train_gpt.step_microbatches(train_gpt.load_corpus(None, args.seq_len + 2), 0, args)
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return batches


def command_lines_end_in_one_error_line(cases) -> None:
    """Runs each ``(argv, env, message)`` of ``cases`` side by side (each process spends most of
    its time importing torch): each exits with status 2 and a stderr of one line starting with
    ``message``."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for argv, env, _ in cases]
    for proc, (argv, _, message) in zip(procs, cases):
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 2 and stderr.startswith(message), (argv, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr


def gpt_step(train_gpt, args, corpus, step: int, ddp, optimizer) -> tuple[list[dict], tuple]:
    """One training step of the example GPT through the schedule: each micro-batch's loss dict (on
    the last pipeline stage) and what ``optimizer.step()`` returned."""
    from megatron_ext import parallel_state as ps
    from megatron_ext.pipeline_parallel import get_forward_backward_func

    optimizer.zero_grad()
    needs_data = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    losses = get_forward_backward_func()(
        forward_step_func=train_gpt.forward_step,
        data_iterator=iter(train_gpt.step_microbatches(corpus, step, args)) if needs_data else None,
        model=ddp, num_microbatches=args.global_batch_size // (args.micro_batch_size * args.dp),
        seq_length=args.seq_len, micro_batch_size=args.micro_batch_size, forward_only=False,
    )
    return losses, optimizer.step()


def has_kernel(op: str, key: str) -> bool:
    """Whether the op ``megatron_ext::<op>`` has a kernel for the dispatch key ``key``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_ext::{op}", key)


def grads_of(out: torch.Tensor, grad: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``out`` (upstream gradient ``grad``) with respect to ``inputs``."""
    return list(torch.autograd.grad(out, inputs, grad))


def float64(values) -> torch.Tensor:
    """A worker's plain values (lists, floats) back as a float64 tensor: workers return plain
    values, since a tensor in the result queue needs its worker alive to be read."""
    return torch.tensor(values, dtype=torch.float64)


def opcheck_report(op, args: tuple) -> dict[str, str]:
    """``torch.library.opcheck``'s result for each of its tests: "SUCCESS", or the error as text (a
    worker returns plain values; an exception may not pickle into the result queue)."""
    report = torch.library.opcheck(op, args, raise_exception=False)
    return {test: str(result) for test, result in report.items()}


def assert_opchecks_passed(reports: list[tuple[str, dict[str, str]]]) -> None:
    """Every ``(label, opcheck_report(...))`` ran its tests and passed them all."""
    for label, report in reports:
        assert report and all(result == "SUCCESS" for result in report.values()), (label, report)


class Comparisons:
    """The ``assert_close`` calls a worker records instead of making, for the test to make them: the
    worker returns ``made`` (plain values: a tensor in the result queue needs its worker alive) and
    the test passes it to ``assert_comparisons``."""

    def __init__(self) -> None:
        self.made: list[tuple] = []

    def close(self, actual, expected, label: str | None = None, **tolerances) -> None:
        label = label or f"comparison {len(self.made)}"
        self.made.append((label, _plain(actual), _plain(expected), tolerances))


def _plain(value):
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return ("tensor", value.detach().cpu().tolist(), dtype, tuple(value.shape))
    return ("value", value)


def _restored(plain):
    if plain[0] == "tensor":
        _, values, dtype, shape = plain
        return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
    return plain[1]


def assert_comparisons(made: list[tuple]) -> None:
    """Makes the comparisons a worker recorded with ``Comparisons.close`` (at least one)."""
    assert made, "the worker recorded no comparison"
    for label, actual, expected, tolerances in made:
        torch.testing.assert_close(
            _restored(actual), _restored(expected), msg=lambda m: f"{label}: {m}", **tolerances
        )


def per_rank(n: int, shape, seed: int) -> list[torch.Tensor]:
    """One float64 tensor per TP rank, the same on every process (so each can compute the
    reference)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(n)]


def train_layouts(layouts, dtypes, schedules, extra) -> dict:
    """The losses of SMALL at each (tp, pp, dp) layout, dtype and schedule (one schedule where
    pp is 1), with ``extra`` arguments: run inside ``run_distributed``."""
    train_gpt = load_train_gpt()
    out = {}
    for tp, pp, dp in layouts:
        for dtype in dtypes:
            for schedule in schedules if pp > 1 else schedules[:1]:
                args = train_gpt.parse_args(SMALL + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
                                                     "--dtype", dtype, "--schedule", schedule] + extra)
                out[(tp, pp, dp, dtype, schedule)] = train_gpt.train(args)["losses"]
    return out


def assert_losses_match(reference: dict, results: dict) -> None:
    """``train_layouts``' losses equal the serial 1F1B run's of the same dtype: within 1e-9
    relative in float64, 1e-5 in float32."""
    for (tp, pp, dp, dtype, schedule), losses in results.items():
        ref = torch.tensor(reference[(1, 1, 1, dtype, "1f1b")], dtype=torch.float64)
        got = torch.tensor(losses, dtype=torch.float64)
        rtol = 1e-9 if dtype == "float64" else 1e-5
        torch.testing.assert_close(
            got, ref, rtol=rtol, atol=0, msg=lambda m: f"{(tp, pp, dp, dtype, schedule)}: {m}"
        )


# The checkpoint tests' runs: four float64 steps.
CHECKPOINT_STEPS = ["--steps", "4", "--dtype", "float64"]


def checkpoint_args(train_gpt, tp: int, pp: int, dp: int, *extra: str):
    """train_gpt's arguments for SMALL over CHECKPOINT_STEPS at (tp, pp, dp), then ``extra``."""
    return train_gpt.parse_args(
        SMALL + CHECKPOINT_STEPS + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), *extra]
    )


def checkpoint_run(layout, *extra) -> dict:
    """What examples/train_gpt.py's ``train`` returns for ``checkpoint_args(*layout, *extra)``."""
    train_gpt = load_train_gpt()
    return train_gpt.train(checkpoint_args(train_gpt, *layout, *extra))


# The words of the small tokenizer tests build (no tokenizer can be downloaded here).
TOKENIZER_WORDS = [f"w{i}" for i in range(297)]


def make_tokenizer_dir(path) -> pathlib.Path:
    """A word-level Hugging Face tokenizer of TOKENIZER_WORDS plus <unk>, <eos> and <pad> (300 ids),
    saved as tokenizer.json and tokenizer_config.json in ``path``; needs the ``tokenizers`` package."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{w: i + 3 for i, w in enumerate(TOKENIZER_WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def random_text(seed: int, documents: int, max_words: int = 60) -> list[str]:
    """``documents`` lines of random TOKENIZER_WORDS."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(documents):
        n = int(torch.randint(1, max_words, (1,), generator=g))
        ids = torch.randint(0, len(TOKENIZER_WORDS), (n,), generator=g).tolist()
        lines.append(" ".join(TOKENIZER_WORDS[i] for i in ids))
    return lines
