"""``python -m megatron_ext.training.launch TORCHRUN_ARGS...``: torchrun (``torch.distributed.run``)
with the same arguments, its output passed through, that ends a failed job with the workers' first
``error:`` line again, after torchrun's own ``ChildFailedError`` report (some 40 lines that would
otherwise bury it). ``./dev.sh train`` runs the example through it; the exit status is torchrun's."""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", *(sys.argv[1:] if argv is None else argv)]
    # Only stderr is read: the workers' stdout (progress, the summary) goes straight through.
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    first_error = None
    try:
        for line in process.stderr:
            sys.stderr.write(line)
            if first_error is None and line.startswith("error: "):
                first_error = line
        code = process.wait()
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached torchrun too: let it stop its workers
        for line in process.stderr:
            sys.stderr.write(line)
        code = process.wait()
    if code != 0 and first_error is not None:
        sys.stderr.write(first_error)
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
