"""keep_freed_memory: a CPU trainer's freed memory serves its next step without page faults."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

# A step's live set, as a training step's activations are: allocated, written, then all freed; five steps.
STEP_MIB = [3, 8, 5, 12, 7, 2, 9, 6]

# Straight through libc, so that no allocation of Python's or torch's lands between the blocks.
PROBE = """
import ctypes, json, resource, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
took = None
if sys.argv[1] == "keep":
    from common.cpu_memory import keep_freed_memory
    took = keep_freed_memory()
faulted = []
for step in range(5):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [(libc.malloc(mib * 2**20), mib) for mib in json.loads(sys.argv[2])]
    for block, mib in blocks:
        ctypes.memset(block, 1, mib * 2**20)
    for block, _ in blocks:
        libc.free(block)
    faulted.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) * 4096 / 2**20)
print(json.dumps({"took": took, "faulted_mib": faulted}))
"""


def probe(mode: str) -> tuple[bool | None, list[float]]:
    """(whether keep_freed_memory took effect, MiB page-faulted in at each step) in a fresh process."""
    env = {"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, json.dumps(STEP_MIB)], check=True, capture_output=True,
                         text=True, cwd=ROOT, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["took"], result["faulted_mib"]


def test_a_freed_step_is_reused_by_the_next_rather_than_faulted_in_again():
    if not sys.platform.startswith("linux"):
        pytest.skip("this tunes glibc's malloc")
    _, default = probe("default")
    took, kept = probe("keep")
    print(f"MiB page-faulted per step of {sum(STEP_MIB)} MiB: default {default}, kept {kept}")
    assert min(default[1:]) > 0.5 * sum(STEP_MIB), "glibc's default reused the steps' memory: this probe tells nothing"
    assert took is True
    assert kept[0] > 0.5 * sum(STEP_MIB)  # the first step maps its memory in either way
    assert max(kept[1:]) < 0.05 * sum(STEP_MIB)
