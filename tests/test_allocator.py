"""draftsmith.allocator: freed big blocks are reused, not mapped and faulted in again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Allocates and frees a 40 MB tensor (above glibc's 32 MB mmap ceiling) 30 times and prints the
# median minor page faults of the last 20 rounds: ~10k (every 4 KB page, every round) when each
# is a fresh mmap. The median, not the mean: now and then one round finds its freed block taken
# by smaller allocations and grows the heap once (seen on Python 3.13), which is not the cost
# guarded here, a fresh block every round.
SCRIPT = """
import resource, statistics, sys, torch
if sys.argv[1] == "reuse":
    from draftsmith.allocator import reuse_freed_memory
    assert reuse_freed_memory()
for _ in range(10):  # the heap settles: the first rounds grow it, as a training run's first steps
    torch.empty(10_000_000).fill_(1.0)
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(10_000_000).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults))
"""


def _faults_per_round(mode: str) -> float:
    # glibc's own malloc is measured even when the tests run under a preloaded tcmalloc.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_freed_big_blocks_are_reused_not_faulted_in_again() -> None:
    pages = 40_000_000 // 4096
    assert _faults_per_round("default") > 0.9 * pages  # the cost being removed is real here
    assert _faults_per_round("reuse") < 0.01 * pages


# Re-executes itself under tcmalloc (as the `draftsmith` command does) and says whether the
# library is mapped into the process that finally runs.
EXEC_SCRIPT = """
import sys
from draftsmith.allocator import exec_under_tcmalloc
exec_under_tcmalloc()
with open("/proc/self/maps") as maps:
    print("tcmalloc" in maps.read(), *sys.argv[1:])
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD and /proc are Linux's")
def test_the_command_reexecutes_itself_under_tcmalloc(tmp_path, monkeypatch) -> None:
    from draftsmith.allocator import tcmalloc_library

    if tcmalloc_library() is None:
        pytest.skip("tcmalloc is not installed (scripts/venv.sh installs it where it can)")
    script = tmp_path / "command.py"
    script.write_text(EXEC_SCRIPT)

    def run() -> str:
        command = [sys.executable, str(script), "a", "b=1"]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("DRAFTSMITH_MALLOC", raising=False)
    assert run() == "True a b=1\n"  # the same arguments, now with tcmalloc mapped
    monkeypatch.setenv("DRAFTSMITH_MALLOC", "glibc")
    assert run() == "False a b=1\n"
