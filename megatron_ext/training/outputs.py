"""What a run leaves: its JSON lines, the loss curve, the summary, the Hugging Face export."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time

import torch.distributed as dist

from megatron_ext.models import GPTModel
from megatron_ext.models.hf import (
    export_hf_state_dict,
    hf_config_dict,
)
from megatron_ext.training import gpt_data
from megatron_ext.training.validation import tokenizer_dir


# What a Hugging Face model directory holds; --export-hf-overwrite removes these first.
HF_MODEL_FILES = ("config.json", "model.safetensors.index.json")


# A Hugging Face tokenizer's files (what save_pretrained writes, fast and slow): --export-hf copies
# those of the run's tokenizer beside the weights.
HF_TOKENIZER_FILES = (*gpt_data.TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                      "vocab.txt", "chat_template.jinja", "chat_template.json")


def export_hf(args: argparse.Namespace, models: list[GPTModel]) -> str:
    """Writes the trained weights as Hugging Face safetensors and config.json, and the files of the
    run's tokenizer (--tokenizer, or --load-hf's) where it has one (rank 0 writes, every rank
    gathers); returns the directory."""
    state = export_hf_state_dict(models)
    hf_config = args.hf_config or hf_config_dict(models)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        os.makedirs(args.export_hf, exist_ok=True)
        for name in os.listdir(args.export_hf):  # the model being replaced (--export-hf-overwrite)
            if name in HF_MODEL_FILES or name in HF_TOKENIZER_FILES or name.endswith(".safetensors"):
                os.remove(os.path.join(args.export_hf, name))
        tensors = {name: t.contiguous() for name, t in state.items()}
        if hf_config.get("tie_word_embeddings"):
            del tensors["lm_head.weight"]  # the embedding, as save_pretrained stores a tied model
        save_file(tensors, os.path.join(args.export_hf, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(args.export_hf, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        tokenizer = tokenizer_dir(args)
        for name in HF_TOKENIZER_FILES if tokenizer is not None else ():
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(args.export_hf, name))
    dist.barrier()
    return args.export_hf


def run_config(args: argparse.Namespace) -> dict:
    config = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    config["world_size"] = dist.get_world_size()
    return config


def log_event(args: argparse.Namespace, **record) -> None:
    """Rank 0 appends one JSON line to --log-json, at once, so a run that dies leaves its steps."""
    if args.log_json and dist.get_rank() == 0:
        with open(args.log_json, "a") as f:
            f.write(json.dumps(strict_json({**record, "time": time.time()}), allow_nan=False) + "\n")


def strict_json(value):
    """``value`` with every NaN or infinite float as None: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_outputs(log: dict, args: argparse.Namespace) -> None:
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(log["start_step"] + 1, log["start_step"] + len(log["losses"]) + 1), log["losses"],
                label="train")
        if log.get("val_losses"):
            ax.plot(*zip(*log["val_losses"]), "o-", label="validation")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss (nats / {'byte' if args.tokens is None else 'token'})")
        c = log["config"]
        ax.set_title(
            f"GPT {c['layers']}x{c['hidden']}, tp {c['tp']} pp {c['pp']} dp {c['dp']}, {c['schedule']}"
        )
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        plt.close(fig)


def summary(log: dict, args: argparse.Namespace) -> str:
    # The first step includes warm-up; it is the figure only when it is the only one.
    timed = log["tokens_per_s"][1:] or log["tokens_per_s"]
    return (
        f"loss {log['losses'][0]:.4f} -> {log['losses'][-1]:.4f} over steps "
        f"{log['start_step'] + 1}-{args.steps}, "
        f"{sum(timed) / len(timed):.0f} tokens/s"
        + (f", validation loss {log['val_losses'][-1][1]:.4f} at step {log['val_losses'][-1][0]}"
           if log.get("val_losses") else "")
        + (f"; loss curve: {args.plot}" if args.plot else "")
    )
