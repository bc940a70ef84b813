"""The GPT program's data, batch and loss: the pieces a pretrain_gpt.py supplies."""

from __future__ import annotations

import argparse
import functools
import glob
import os
import sysconfig

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.comm_errors import reported
from megatron_ext.distributed import (
    DistributedDataParallel,
)
from megatron_ext.training import gpt_data
from megatron_ext.utils import get_batch_on_this_cp_rank, get_thd_batch_on_this_cp_rank


DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024


def load_corpus(path: str | None, min_bytes: int, tokenizer: str | None = None) -> torch.Tensor:
    """The training text as byte ids, or as the token ids of ``tokenizer`` (a directory). Default:
    the standard library's top-level sources, in name order, which every machine with this Python
    has."""
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
    else:
        chunks, size = [], 0
        for name in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            with open(name, "rb") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
            if size >= DEFAULT_CORPUS_BYTES:
                break
        data = b"".join(chunks)[:DEFAULT_CORPUS_BYTES]
    if tokenizer is not None:
        ids = gpt_data.HuggingFaceTokenizer(tokenizer).tokenize(data.decode("utf-8", errors="replace"))
        if len(ids) < min_bytes:
            raise ValueError(
                f"the corpus has {len(ids)} tokens; at least {min_bytes} are needed (--seq-len + 2)")
        return torch.tensor(ids, dtype=torch.long)
    if len(data) < min_bytes:
        raise ValueError(f"the corpus has {len(data)} bytes; at least {min_bytes} are needed (--seq-len + 2)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def step_microbatches(corpus: torch.Tensor, step: int, args: argparse.Namespace,
                      device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch of ``step``.

    The global batch is the same set of samples in every layout: its sample offsets depend only
    on the seed and the step; data-parallel rank d takes the d-th contiguous share of it.
    """
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    offsets = torch.randint(0, corpus.numel() - args.seq_len - 1, (args.global_batch_size,), generator=g)
    per_rank = args.global_batch_size // args.dp
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = offsets[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    window = torch.arange(args.seq_len + 1)
    samples = corpus[mine[:, None] + window].to(device)  # [per_rank, s + 1]
    return [
        {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
        for mb in samples.split(args.micro_batch_size)
    ]


def loss_func(loss_mask: torch.Tensor | None,
              output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean over the micro-batch's tokens (those of ``loss_mask``, where given). With context
    parallelism each rank holds part of each sequence: its sum over the token count summed over the cp
    ranks (the schedule multiplies by cp and DDP averages over dp x cp), and the reported loss is the
    sum over cp."""
    output = output.float() if output.dtype != torch.float64 else output
    cp_group = parallel_state.get_context_parallel_group()
    if loss_mask is not None:
        output = output * loss_mask.to(output.dtype)
    count = torch.tensor(output.numel() if loss_mask is None else loss_mask.sum().item(), dtype=output.dtype)
    if cp_group.size() == 1:
        loss = output.mean() if loss_mask is None else output.sum() / count.clamp(min=1)
        return loss, {"lm loss": loss.detach()}
    totals = torch.stack([output.detach().sum(), count.to(output.device)])
    with reported("all-reduce of the loss over the context-parallel group", cp_group):
        dist.all_reduce(totals, group=cp_group)
    return output.sum() / totals[1], {"lm loss": totals[0] / totals[1]}


def token_sum_loss_func(loss_mask: torch.Tensor | None,
                        output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss summed over the micro-batch's tokens of ``loss_mask`` and their count, Megatron-LM's
    three values under ``calculate_per_token_loss``: the schedule sums them over the micro-batches,
    finalize_model_grads divides the gradients by the count summed over the data- and
    context-parallel ranks, so the step's loss is the mean over every masked-in token of the global
    batch, however they lie in rows, micro-batches and ranks. Reported: the [sum, count] pair."""
    output = output.float() if output.dtype != torch.float64 else output
    if loss_mask is None:  # every token counts
        loss_mask = torch.ones_like(output)
    total = (output * loss_mask.to(output.dtype)).sum()
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.to(total.dtype)])}


def forward_step(data_iterator, model: DistributedDataParallel):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        return model(None, None), loss_func
    tokens = batch["tokens"]
    packed_seq_params = None
    if "cu_seqlens" in batch:  # one packed row: the thd format, each sequence split over cp on its own
        batch = dict(batch)
        cu_seqlens = batch.pop("cu_seqlens").reshape(-1)
        # The rows' boundaries are the layout, each sequence padded to a multiple of 2 x cp.
        batch, packed_seq_params = get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens,
                                                                 batch.pop("max_seqlen").reshape(-1))
    else:
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        batch = get_batch_on_this_cp_rank({"position_ids": positions, **batch})
    loss_mask = batch.get("loss_mask")
    # --sft rows mark their padding: the MoE routers leave it out of their losses and counts
    # (Megatron-LM's training loop passes no padding_mask, so its routers count the padding).
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                   packed_seq_params=packed_seq_params, loss_mask=loss_mask,
                   padding_mask=batch.get("padding_mask"))
    if getattr(model, "module", model).config.calculate_per_token_loss:
        return output, functools.partial(token_sum_loss_func, loss_mask)
    return output, functools.partial(loss_func, loss_mask)
