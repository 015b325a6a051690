"""Starting jobs: ``loom.launch`` inside a script, the ``loom`` CLI outside, both on torchrun."""

from loom.launch.spawn import launch
from loom.launch.torchrun import LaunchOptions, run_job

__all__ = ["LaunchOptions", "launch", "run_job"]
