"""examples/train_gpt.py under torchrun, with workers killed in chosen attempts (used by
tests/test_faults.py):

- ``KILL_AT_STEP=attempt,rank,step``: that rank SIGKILLs itself when it reaches step ``step``
  (counted from 0) in that attempt (``TORCHELASTIC_RESTART_COUNT``);
- ``KILL_IN_SAVE=attempt,rank``: that rank SIGKILLs itself in the attempt's first save, after its
  files are written and before the checkpoint is complete.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.conftest import load_train_gpt  # noqa: E402


def _chosen(variable: str) -> list[int] | None:
    """The rest of ``variable``'s numbers when its attempt and rank are this process's."""
    if variable not in os.environ:
        return None
    attempt, rank, *rest = (int(v) for v in os.environ[variable].split(","))
    here = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ["RANK"]))
    return rest if (attempt, rank) == here else None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    train_gpt = load_train_gpt()
    at_step = _chosen("KILL_AT_STEP")
    if at_step is not None:
        original = train_gpt.step_microbatches

        def step_or_die(corpus, step, args, device):
            if step == at_step[0]:
                _die()
            return original(corpus, step, args, device)

        train_gpt.step_microbatches = step_or_die
    if _chosen("KILL_IN_SAVE") is not None:
        from megatron_ext.training import checkpointing as checkpoint

        checkpoint._after_rank_wrote = _die
    try:
        train_gpt.main()
    except (ValueError, train_gpt.CheckpointingException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
