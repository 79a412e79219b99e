"""`python -m draftsmith.train [overrides]`: the train stage, for `deepspeed -m draftsmith.train`
and torchrun launches (every rank runs the same Hydra app; only rank 0 writes shared files)."""

import sys

from draftsmith.cli import run_stage

if __name__ == "__main__":
    # deepspeed's launcher appends --local_rank=N; the rank also arrives as LOCAL_RANK in the env
    run_stage("train", [a for a in sys.argv[1:] if not a.startswith("--local_rank")])
