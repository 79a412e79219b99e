"""`python -m draftsmith.train [overrides]`: the train stage, for `deepspeed -m draftsmith.train`
and torchrun launches (every rank runs the same Hydra app; only rank 0 writes shared files).
`--config=<yaml>` instead of overrides: the config `launcher=deepspeed` saved for its ranks."""

import os
import sys

from draftsmith.cli import interrupted, run_stage
from draftsmith.errors import InputError


def main(args: list[str]) -> None:
    """The train stage for `args` (overrides, or the one `--config=<yaml>`)."""
    if len(args) == 1 and args[0].startswith("--config="):
        from draftsmith.allocator import reuse_freed_memory
        from draftsmith.config import load_config
        from draftsmith.train.launch import run

        reuse_freed_memory()  # as run_stage does for every stage
        run(load_config(args[0].removeprefix("--config=")))
    else:
        run_stage("train", args)


if __name__ == "__main__":
    # deepspeed's launcher appends --local_rank=N; the rank also arrives as LOCAL_RANK in the env
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    try:
        main(args)
    except KeyboardInterrupt:  # a Ctrl-C reaches every rank
        # ranks `draftsmith train launcher=deepspeed` started (its saved config) leave saying
        # what was kept to that one process
        sys.exit(130 if any(a.startswith("--config=") for a in args) else interrupted("train"))
    except InputError as err:  # (launched ranks; run_stage ends other runs in the message too)
        sys.exit(f"draftsmith train (rank {os.environ.get('RANK', '0')}): {err}")
