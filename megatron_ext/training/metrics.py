"""What a user watches during a run, beside the JSON lines: TensorBoard event files (``--tensorboard-dir``,
written by ``torch.utils.tensorboard.SummaryWriter``) and Weights & Biases (``--wandb-project``).

``MetricsWriter`` writes on global rank 0 only; on every other rank each method does nothing. It never
runs a collective: the loop hands it values every rank already knows. The missing-package errors are
raised on every rank alike (a local import check), so no rank waits for one that failed.

The tags are Megatron-LM's (``training_log`` and ``evaluate_and_print_results`` of
``megatron/training/training.py``, ``track_moe_metrics``, ``MTPLossLoggingHelper.track_mtp_metrics``
at core_v0.16.1), under the same keys in W&B:

- loss: ``lm loss``
- learning rate: ``learning-rate``
- gradient norm: ``grad-norm`` (None on a skipped step: not written)
- loss scale (fp16): ``loss-scale`` (Megatron-LM: with --log-loss-scale-to-tensorboard)
- tokens per second: ``tokens-per-sec``, our tag (Megatron-LM's ``throughput`` is TFLOP/s per GPU,
  which is not computed here)
- MoE auxiliary losses: the router's names, ``load_balancing_loss``, ``seq_load_balancing_loss``,
  ``global_load_balancing_loss``, ``z_loss``
- multi-token prediction losses: ``mtp_1 loss``, ``mtp_2 loss``, ...
- memory on a CUDA device (``memory_stats``): ``mem-reserved-bytes``, ``mem-allocated-bytes``,
  ``mem-max-allocated-bytes``, ``mem-allocated-count`` (Megatron-LM: with --log-memory-to-tensorboard)
- memory on the CPU: ``mem-max-rss-bytes``, our tag: the process's peak resident set size
- validation loss: ``lm loss validation``, at every evaluation
- validation perplexity: ``lm loss validation ppl`` (Megatron-LM: with
  --log-validation-ppl-to-tensorboard, and as exp(min(20, loss)); here the loop's value)
- the run's configuration: one TensorBoard text per key (Megatron-LM's ``write_args_to_tensorboard``),
  and ``wandb.init``'s ``config``

Training values are written at the steps that are multiples of ``log_interval`` (Megatron-LM's
``--tensorboard-log-interval``), evaluations at every evaluation. A value of None is not written (it is
unknown, e.g. the gradient norm of a skipped step); NaN and infinities are written as they are (both
TensorBoard's event files and W&B store them), so a divergence shows in the curves instead of a gap.
Megatron-LM's ``... vs samples`` twins of each tag are not written: with a constant global batch they
are the step axis scaled.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any, Mapping

import torch
import torch.distributed as dist

LOSS_TAG = "lm loss"
VALIDATION_LOSS_TAG = "lm loss validation"
VALIDATION_PPL_TAG = "lm loss validation ppl"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def train_step_values(
    *,
    loss: float,
    learning_rate: float | None,
    grad_norm: float | None,
    tokens_per_s: float | None,
    loss_scale: float | None = None,
    moe_losses: Mapping[str, float] | None = None,
    mtp_losses: Mapping[str, float] | None = None,
    memory: Mapping[str, float] | None = None,
) -> dict[str, float | None]:
    """One training step's values under their tags (see the module's table). ``moe_losses`` and
    ``mtp_losses`` are keyed by their tags already (``load_balancing_loss``, ``mtp_1 loss``, ...), as
    the loop's JSON lines key them; ``memory`` is ``memory_stats(device)``."""
    values: dict[str, float | None] = {
        LOSS_TAG: loss,
        "learning-rate": learning_rate,
        "grad-norm": grad_norm,
        "tokens-per-sec": tokens_per_s,
        "loss-scale": loss_scale,
    }
    for extra in (moe_losses, mtp_losses, memory):
        for tag, value in (extra or {}).items():
            if tag in values:
                raise ValueError(f"train_step_values: the tag {tag!r} is given twice")
            values[tag] = value
    return values


def eval_values(loss: float, ppl: float) -> dict[str, float | None]:
    """One evaluation's validation loss and perplexity under their tags. The perplexity is the
    loop's (Megatron-LM writes exp(min(20, loss)))."""
    return {VALIDATION_LOSS_TAG: loss, VALIDATION_PPL_TAG: ppl}


def memory_stats(device: torch.device | str) -> dict[str, int]:
    """This process's memory under its tags: on a CUDA device the caching allocator's counters that
    Megatron-LM logs (current reserved and allocated bytes, the peak allocated bytes, the number of
    live allocations); elsewhere the process's peak resident set size in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0),
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # getrusage reports kibibytes on Linux, bytes on macOS.
    return {"mem-max-rss-bytes": peak if sys.platform == "darwin" else peak * 1024}


class MetricsWriter:
    """TensorBoard and W&B writers of one run, active on global rank 0 (built after the process group,
    if any). ``tensorboard_dir``: the event files' directory (None: no TensorBoard). ``wandb_project``
    (None: no W&B) with ``wandb_exp_name`` (the run's name, required as in Megatron-LM) and
    ``wandb_save_dir`` (W&B's ``dir``; None: W&B's default; Megatron-LM's default is the checkpoint
    directory's ``wandb``, the caller's to pass). ``config``: the run's configuration, recorded once,
    as ``wandb.init``'s ``config`` and as one TensorBoard text per key at ``start_step``."""

    def __init__(
        self,
        *,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        wandb_exp_name: str | None = None,
        wandb_save_dir: str | None = None,
        log_interval: int = 1,
        config: Mapping[str, Any] | None = None,
        start_step: int = 0,
    ) -> None:
        if not isinstance(log_interval, int) or isinstance(log_interval, bool) or log_interval < 1:
            raise ValueError(f"MetricsWriter: log_interval {log_interval!r}: expected an integer >= 1")
        summary_writer = wandb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter as summary_writer
            except ImportError:
                raise ValueError(
                    "--tensorboard-dir needs the tensorboard package (pip install tensorboard)"
                ) from None
        if wandb_project is not None:
            if not wandb_exp_name:
                raise ValueError(f"--wandb-project {wandb_project!r} needs --wandb-exp-name (the run's name)")
            try:
                import wandb
            except ImportError:
                raise ValueError("--wandb-project needs the wandb package (pip install wandb)") from None
        self.log_interval = log_interval
        self.active = _rank() == 0
        self._tensorboard: Any = None
        self._wandb: Any = None
        if not self.active:
            return
        config = dict(config or {})
        if summary_writer is not None:
            self._tensorboard = summary_writer(log_dir=tensorboard_dir)
            for key, value in config.items():
                self._tensorboard.add_text(str(key), str(value), global_step=start_step)
        if wandb is not None:
            if wandb_save_dir is not None:
                os.makedirs(wandb_save_dir, exist_ok=True)
            wandb.init(project=wandb_project, name=wandb_exp_name, dir=wandb_save_dir, config=config)
            self._wandb = wandb

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Writes each value at ``step`` under its tag (None: left out), whatever the step."""
        if not self.active:
            return
        present = {tag: float(value) for tag, value in values.items() if value is not None}
        if self._tensorboard is not None:
            for tag, value in present.items():
                self._tensorboard.add_scalar(tag, value, step)
        if self._wandb is not None and present:
            self._wandb.log(present, step=step)

    def log_train(self, step: int, **values: Any) -> None:
        """One training step (``train_step_values``' arguments), written when ``step`` is a multiple
        of ``log_interval``."""
        if self.active and step % self.log_interval == 0:
            self.scalars(step, train_step_values(**values))

    def log_eval(self, step: int, loss: float, ppl: float) -> None:
        """One evaluation after ``step``: its validation loss and perplexity."""
        self.scalars(step, eval_values(loss, ppl))

    def text(self, tag: str, value: str, step: int = 0) -> None:
        """A text at ``step`` in TensorBoard (W&B keeps the configuration as ``wandb.init``'s)."""
        if self._tensorboard is not None:
            self._tensorboard.add_text(tag, value, global_step=step)

    def close(self) -> None:
        """Flushes and closes the event file and finishes the W&B run; a second call does nothing."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
