"""What a user watches while a run goes: after every step one JSON line (--log-json), the progress
bar or, with --log-interval N, a line every N steps (Megatron-LM's), and the TensorBoard / W&B
scalars (--tensorboard-dir, --wandb-project); after every evaluation the same for the validation
loss. Rank 0 writes; every rank calls with the values every rank knows."""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist

from megatron_ext.training.metrics import MetricsWriter, memory_stats
from megatron_ext.training.outputs import log_event


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp(710) overflows a float


class RunLog:
    """The run's outputs as it goes, from ``start_step``; ``close`` at the end."""

    def __init__(self, args: argparse.Namespace, start_step: int, config: dict, device: torch.device) -> None:
        self.args, self.device, self.rank0 = args, device, dist.get_rank() == 0
        self.metrics = MetricsWriter(tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project,
                                     wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
                                     log_interval=args.tensorboard_log_interval, config=config,
                                     start_step=start_step)
        self.progress = None
        if self.rank0 and not args.no_progress and args.log_interval is None:
            from tqdm import tqdm

            self.progress = tqdm(total=args.steps, initial=start_step, desc="train", unit="step",
                                 dynamic_ncols=True)
        self.interval: list[dict] = []  # the steps since the last --log-interval line
        self.val: tuple[float, float] | None = None  # the last evaluation's loss and perplexity

    def step(self, step: int, *, loss: float, learning_rate: float, grad_norm: float | None, skipped: bool,
             tokens_per_s: float, loss_scale: float | None, extra: dict, losses: dict) -> None:
        """Step ``step`` (1-based) done: ``extra`` goes to the JSON line only (e.g. the response tokens),
        ``losses`` (the MoE and MTP losses by name) everywhere."""
        log_event(self.args, step=step, loss=loss, tokens_per_s=tokens_per_s, grad_norm=grad_norm,
                  skipped=skipped, learning_rate=learning_rate, **extra, **losses)
        moe = {k: v for k, v in losses.items() if not k.startswith("mtp_")}
        mtp = {k: v for k, v in losses.items() if k.startswith("mtp_")}
        self.metrics.log_train(step, loss=loss, learning_rate=learning_rate, grad_norm=grad_norm,
                               tokens_per_s=tokens_per_s, loss_scale=loss_scale, moe_losses=moe,
                               mtp_losses=mtp, memory=memory_stats(self.device))
        if self.progress is not None:
            shown = {name: f"{value:.4f}" for name, value in losses.items()}
            if self.val is not None:
                shown.update(val_loss=f"{self.val[0]:.4f}", val_ppl=f"{self.val[1]:.1f}")
            self.progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", **shown)
            self.progress.update(1)
        self.interval.append(dict(loss=loss, grad_norm=grad_norm, skipped=skipped, tokens_per_s=tokens_per_s,
                                  **losses))
        if self.args.log_interval is not None and step % self.args.log_interval == 0:
            self._line(step, learning_rate, loss_scale)

    def _line(self, step: int, learning_rate: float, loss_scale: float | None) -> None:
        """Megatron-LM's line: the interval's mean loss (and MoE / MTP losses), the last grad norm."""
        steps, self.interval = self.interval, []
        if not self.rank0:
            return
        mean = {key: sum(s[key] for s in steps) / len(steps)
                for key in steps[-1] if key not in ("grad_norm", "skipped", "tokens_per_s")}
        norm = steps[-1]["grad_norm"]
        parts = [f"iteration {step:8d}/{self.args.steps:8d}",
                 f"consumed samples: {step * self.args.global_batch_size:12d}",
                 f"learning rate: {learning_rate:.6E}",
                 f"global batch size: {self.args.global_batch_size:5d}",
                 *(f"{name if name != 'loss' else 'lm loss'}: {value:.6E}" for name, value in mean.items()),
                 *([f"loss scale: {loss_scale:.1f}"] if loss_scale is not None else []),
                 f"grad norm: {norm:.3f}" if norm is not None else "grad norm: skipped",
                 f"tokens/s: {sum(s['tokens_per_s'] for s in steps) / len(steps):.0f}",
                 f"number of skipped iterations: {sum(s['skipped'] for s in steps):3d}"]
        print(" | ".join(parts) + " |", flush=True)

    def evaluation(self, step: int, loss: float, extra: dict) -> None:
        ppl = perplexity(loss)
        self.val = (loss, ppl)
        log_event(self.args, event="eval", step=step, val_loss=loss, val_ppl=ppl, **extra)
        self.metrics.log_eval(step, loss, ppl)
        if self.args.log_interval is not None and self.rank0:
            print(f"validation loss at iteration {step} | lm loss value: {loss:.6E} | "
                  f"lm loss PPL: {ppl:.6E} |", flush=True)

    def notice(self, text: str) -> None:
        """A line for the user on stderr (rank 0), clear of the progress bar."""
        if not self.rank0:
            return
        if self.progress is not None:
            self.progress.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.metrics.close()
