"""The ``loom`` command: ``loom run`` starts a job, ``loom env`` shows what it would be."""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import MISSING, fields
from typing import Any

import torch

from loom.cluster import TorchrunEnvironment
from loom.comm.process_group import default_backend, resolve_timeout
from loom.devices import available_cores, cuda_count
from loom.errors import LoomError
from loom.launch.torchrun import LaunchOptions, run_job


def _value_type(hint: Any) -> Any:
    """``int | None`` -> ``int``: what argparse should convert the flag's text to."""
    options = [t for t in typing.get_args(hint) if t is not type(None)]
    return options[0] if options else hint


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(LaunchOptions)
    for f in fields(LaunchOptions):
        default = None if f.default is MISSING else f.default
        parser.add_argument("--" + f.name.replace("_", "-"), type=_value_type(hints[f.name]), default=default, help=f.metadata["help"])


def _options(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(**{f.name: getattr(args, f.name) for f in fields(LaunchOptions)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Scale a PyTorch training script over devices and machines.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a training script as a job of one process per replica")
    _add_launch_options(run)
    run.add_argument("-m", "--module", action="store_true", help="treat SCRIPT as a module name, like python -m")
    run.add_argument("script", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    env = commands.add_parser("env", help="print the cluster, devices and threads a job started here would get")
    _add_launch_options(env)
    return parser


def describe_environment(opts: LaunchOptions) -> list[tuple[str, str]]:
    """What ``loom run`` with these options would resolve on this machine (or, in a worker, what it did)."""
    node = opts.node()
    nproc = opts.processes()
    gpus = cuda_count()
    device = torch.device("cuda" if gpus else "cpu")
    rows = [
        ("cluster from", node.source),
        ("nodes", str(node.nnodes)),
        ("this node's rank", str(node.node_rank)),
        ("master", f"{node.master_addr}:{node.master_port}" if node.master_port else "local (free port picked at launch)"),
    ]
    if node.hosts:
        rows.append(("hosts", ", ".join(node.hosts)))
    rows += [
        ("processes per node", str(nproc)),
        ("world size", str(nproc * node.nnodes)),
        ("devices", f"{gpus} CUDA GPU(s)" if gpus else f"CPU, {available_cores()} core(s)"),
        ("threads per process", str(opts.threads_per_process())),
        ("backend", default_backend(device)),
        ("collective timeout", f"{resolve_timeout(opts.timeout):g}s"),
    ]
    if TorchrunEnvironment.detect():
        spec = TorchrunEnvironment.resolve()
        rows.append(("this process", f"rank {spec.rank} of {spec.world_size}, local rank {spec.local_rank}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = _options(args)
        if args.command == "env":
            rows = describe_environment(opts)
            width = max(len(k) for k, _ in rows)
            for key, value in rows:
                print(f"{key:<{width}}  {value}")
            return 0
        entry = (["-m"] if args.module else []) + [args.script, *args.script_args]
        return run_job(entry, opts)
    except LoomError as exc:
        print(f"loom: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
