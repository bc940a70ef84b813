"""examples/train_gpt.py under torchrun, with one worker killed in the first attempt: the first
attempt's rank ``KILL_RANK`` SIGKILLs itself when it reaches step ``KILL_AT_STEP`` (counted from 0,
after the checkpoints of the steps before it were saved). Used by tests/test_faults.py."""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.test_gpt_training import _train_gpt  # noqa: E402

if __name__ == "__main__":
    train_gpt = _train_gpt()
    kill_rank, kill_at = int(os.environ["KILL_RANK"]), int(os.environ["KILL_AT_STEP"])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and int(os.environ["RANK"]) == kill_rank:
        original = train_gpt.step_microbatches

        def die(corpus, step, args, device):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(corpus, step, args, device)

        train_gpt.step_microbatches = die
    try:
        train_gpt.main()
    except (ValueError, train_gpt.CheckpointingException) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
