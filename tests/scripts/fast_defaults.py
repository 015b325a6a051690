"""Prepare a small model at loom's defaults (or with the flags given), then say how the process's
allocator serves a 40 MiB block made again and again: ``faults N`` (minor page faults of the
last five); above glibc's largest sliding mmap threshold, it is unmapped at free unless kept.

    python tests/scripts/fast_defaults.py [off] [then-default]
"""

import resource
import sys

import torch
from torch import nn

import loom

BLOCK = 10 << 20  # floats: 40 MiB


def faults() -> int:
    counts = []
    for _ in range(40):  # the heap grows to its working size, then serves every block
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(BLOCK)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(counts[-5:])


def main() -> None:
    strategy = loom.OneDeviceStrategy(device="cpu")
    for setting in sys.argv[1:] or ["default"]:
        strategy.prepare(nn.Linear(4, 2), fast_path=False if setting == "off" else None)
        print(f"faults {faults()}", flush=True)


if __name__ == "__main__":
    main()
