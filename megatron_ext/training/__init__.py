"""The training-level pieces above the model, DDP and optimizer packages: the run's checkpoint
manager (``checkpointing``: ``save_checkpoint`` / ``load_checkpoint``, Megatron-LM's
``megatron/training/checkpointing.py``)."""
