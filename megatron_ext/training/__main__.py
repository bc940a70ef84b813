"""``python -m megatron_ext.training ARGS``: the training program (``megatron-ext-train``), one
process of it; under torchrun: ``torchrun --nproc-per-node 4 -m megatron_ext.training ARGS``."""

import sys

from megatron_ext.training.training import run

if __name__ == "__main__":
    sys.exit(run())
