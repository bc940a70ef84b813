"""Trains a GPT with tensor x pipeline x context x expert x data parallelism: megatron_ext's
``pretrain_gpt.py``.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 ...

The number of processes must equal tp x cp x pp x dp (dp is inferred when not given). Every layout
trains the same model on the same global batches: with the same seed and global batch the
per-step losses agree across layouts (exactly, up to rounding, in float64). The flags (Megatron-LM's
names, and short ones) are in docs/training_cli.md; ``megatron-ext-train`` runs the same program.

A program of one's own keeps this file's shape: a model provider, a forward step that reads the
batch and names the loss, and the call into ``megatron_ext.training``.
"""

import sys

from megatron_ext.training.gpt import forward_step  # the batch, the model's call, the loss
from megatron_ext.training.model import build_model
from megatron_ext.training.training import run


def model_provider(args, device):
    """This rank's model chunks (one GPTModel, or one per virtual pipeline stage) for the flags
    ``args``: the TransformerConfig they describe, a Hugging Face model's with --load-hf."""
    return build_model(args, device)


if __name__ == "__main__":
    sys.exit(run(model_provider=model_provider, forward_step_func=forward_step))
