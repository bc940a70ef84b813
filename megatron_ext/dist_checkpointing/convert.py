"""The checkpoint converter's earlier command, kept working:
``python -m megatron_ext.dist_checkpointing.convert ARGS`` runs ``python -m megatron_ext.training.convert
ARGS``. The converter reads and writes training checkpoints, so it lives at the training level;
this package imports nothing of it (the command is started by name, only when run as a program)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("megatron_ext.training.convert", run_name="__main__", alter_sys=True)
