"""The ``loom`` command: ``loom run`` starts a job (``loom lighthouse`` coordinates its replica groups
across machines), ``loom env`` shows what it would be, ``loom doctor``
checks that it would start, ``loom stacks`` shows where a running one is, ``loom checkpoint``
inspects, verifies and exports checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import MISSING, fields
from typing import Any

import torch

from loom.cluster import ParameterServerCluster, TorchrunEnvironment
from loom.comm.process_group import default_backend, resolve_timeout
from loom.devices import available_cores, cuda_count
from loom.errors import LaunchError, LoomError
from loom.launch.parameter_server import JobOptions, run_parameter_server_job, run_parameter_server_task
from loom.launch.shadow import check_not_shadowed
from loom.launch.torchrun import LaunchOptions, check_timeouts, run_job
from loom.strategies.xla import export as xla_export


def _value_type(hint: Any) -> Any:
    """``int | None`` -> ``int``: what argparse should convert the flag's text to."""
    options = [t for t in typing.get_args(hint) if t is not type(None)]
    return options[0] if options else hint


def _add_launch_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(LaunchOptions)
    for f in fields(LaunchOptions):
        if f.name in skip:
            continue
        default = None if f.default is MISSING else f.default
        parser.add_argument("--" + f.name.replace("_", "-"), type=_value_type(hints[f.name]), default=default, help=f.metadata["help"])


def _options(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(**{f.name: getattr(args, f.name, None) for f in fields(LaunchOptions)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Scale a PyTorch training script over devices and machines.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a training script as a job of one process per replica")
    _add_launch_options(run)
    run.add_argument("-m", "--module", action="store_true", help="treat SCRIPT as a module name, like python -m")
    run.add_argument("--ps", type=int, help="start this many parameter servers here (asynchronous training; with --workers)")
    run.add_argument("--workers", type=int, help="parameter-server workers, the chief (worker 0) included; each restarted alone on failure")
    run.add_argument("--ps-hosts", help="across machines: every parameter server's HOST:PORT, comma-separated, the same everywhere")
    run.add_argument("--role", choices=("ps", "worker"), help="across machines: what this machine runs (with --ps-hosts and --workers)")
    run.add_argument("--index", type=int, help="across machines: which server or worker this is (default 0; worker 0 is the chief)")
    run.add_argument("--staleness", type=int, help="keep each worker within this many steps of the slowest (with --ps; 0: lockstep)")
    run.add_argument("--sync", action="store_true", help="synchronous parameter servers: each step applies the mean of every worker's gradients")
    run.add_argument("--ps-checkpoint-dir", help="where parameter servers save their state (with --ps; default: a temporary directory)")
    run.add_argument("--ps-tls-cert", help="parameter servers: PEM certificate for TLS, naming every server's host (or LOOM_PS_TLS_CERT)")
    run.add_argument("--ps-tls-key", help="parameter servers: the certificate's private key, where servers run (or LOOM_PS_TLS_KEY)")
    run.add_argument("--groups", type=int, help="replica groups of --nproc processes each, on this machine: a group that fails is restarted (--max-restarts) and heals while the others train on")
    run.add_argument("--lighthouse", help="with --groups: HOST:PORT of a lighthouse started elsewhere (`loom lighthouse`; default: one started here)")
    run.add_argument("--group", type=int, help="across machines: run only group I of --groups G here, joining the job at --lighthouse")
    run.add_argument("script", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    lighthouse = commands.add_parser("lighthouse", help="coordinate replica groups on other hosts (each: loom run --lighthouse HOST:PORT --groups G --group I)")
    lighthouse.add_argument("--port", type=int, default=29510, help="port to listen on, on every interface (default 29510; 0: a free one)")
    lighthouse.add_argument("--min-groups", type=int, default=1, help="groups a step needs (default 1: one surviving group trains on)")
    scale = commands.add_parser("scale", help="run a training script at several sizes and chart samples/s against replicas")
    _add_launch_options(scale, skip=("nproc", "nnodes", "node_rank", "master"))
    scale.add_argument("--nproc", dest="sizes", default="1,2", help="the sizes to run, processes on this machine, comma-separated (default 1,2)")
    scale.add_argument("--steps", type=int, default=20, help="training steps timed at each size (after one start-up step)")
    scale.add_argument("--out", default="runs/scale", help="where scale.json, scale.png and each size's breakdown go")
    scale.add_argument("script", help="the training script")
    scale.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    env = commands.add_parser("env", help="print the cluster, devices and threads a job started here would get")
    _add_launch_options(env)
    doctor = commands.add_parser("doctor", help="check, on each node as `loom run` would start there, that a job would start")
    _add_launch_options(doctor)
    doctor.add_argument("--checkpoint-dir", help="check that every node can write this directory and sees the same one")
    doctor.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the master and the other nodes")
    stacks = commands.add_parser("stacks", help="print where each rank of a running job is: its collective and Python stack")
    stacks.add_argument("--master", help="the job's HOST:PORT; default: the job running on this machine")
    checkpoint = commands.add_parser("checkpoint", help="look into a checkpoint, check it, or export its weights")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="list what a checkpoint holds")
    inspect.add_argument("directory", help="a checkpoint, or a directory of them (the newest is taken)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    export = actions.add_parser("export", help="write a model for serving: its consolidated weights, or a torch.export/ONNX program")
    export.add_argument("directory", help="a checkpoint, or a directory of them (the newest is taken)")
    export.add_argument("output", help="the file to write: .safetensors, .pt2 or .onnx (the .pt2 is written beside it)")
    export.add_argument("--name", help="which saved model, when there are several")
    export.add_argument("--format", choices=("pt2", "onnx", "safetensors"), help="default: from OUTPUT's suffix, else safetensors")
    export.add_argument("--model", help="pt2/onnx: MODULE:FUNCTION that builds the model as in training (importable from here)")
    export.add_argument("--input-shape", help="pt2/onnx: one batch's shape, e.g. 1,4 (the batch dimension stays free where it can)")
    export.add_argument("--input-dtype", choices=("float32", "int64"), default="float32", help="pt2/onnx: the batch's dtype")
    verify = actions.add_parser("verify", help="check every file of each checkpoint against its recorded size and digest")
    verify.add_argument("directory", help="a checkpoint, or a directory of them (each is checked)")
    xla_export.add_commands(commands.add_parser("xla", help="TPUStrategy: export a script's compiled training step"))
    return parser


def _checkpoint_command(args: argparse.Namespace) -> int:
    from loom.checkpoint.describe import describe, verify

    if args.action == "verify":
        results = verify(args.directory)
        for path, intact, said in results:
            print(f"{path}: {said}" if intact else said, file=sys.stdout if intact else sys.stderr)  # a damage names its file
        return 0 if all(intact for _, intact, _ in results) else 1
    if args.action == "export":
        from loom.train.export import export_checkpoint

        for out in export_checkpoint(args.directory, args.output, args.format, args.name, args.model, args.input_shape, args.input_dtype):
            print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        return 0
    info = describe(args.directory)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}: step {info['step']}, saved by {info['strategy']} on {info['world_size']} replica(s) at {info['saved_at']}, {info['bytes']:,} bytes")
    print("objects: " + ", ".join(f"{k} ({v})" for k, v in info["objects"].items()))
    for key, value in info["values"].items():
        print(f"  {key} = {json.dumps(value)[:100]}")
    width = max((len(k) for k in info["tensors"]), default=0)
    for key, tensor in info["tensors"].items():
        print(f"  {key:<{width}}  {tensor['dtype']:<9} {tensor['shape']}")
    return 0


def _groups_command(entry: list[str], opts: LaunchOptions, args: argparse.Namespace) -> int:
    from loom.launch.groups import run_groups

    if args.group is not None and not args.lighthouse:
        raise LaunchError("--group I runs one group of a job across machines: add --lighthouse HOST:PORT (start it with `loom lighthouse`)")
    if args.groups is None:
        raise LaunchError(f"{'--group' if args.group is not None else '--lighthouse'} is for replica groups: add --groups G (the job's number of groups)")
    if args.ps is not None or args.ps_hosts or args.workers is not None:
        raise LaunchError("--groups replicates the model in every group; parameter servers (--ps, --ps-hosts, --workers) shard it instead: use one or the other")
    return run_groups(entry, opts, args.groups, args.lighthouse, args.group)


def describe_environment(opts: LaunchOptions) -> list[tuple[str, str]]:
    """What ``loom run`` with these options would resolve on this machine (or, in a worker, what it did)."""
    ps = ParameterServerCluster.from_tf_config()
    if ps is not None:
        task = f", listening on {ps.address}" if ps.role == "ps" else " (the chief)" if ps.index == 0 else ""
        return [
            ("cluster from", f"{ps.source} (parameter servers)"),
            ("this task", f"{ps.role} {ps.index}{task}"),
            ("parameter servers", ", ".join(ps.servers)),
            ("workers", f"{ps.workers} (worker 0 is the chief)"),
            ("devices", f"CPU, {available_cores()} core(s)"),
        ]
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
        ("replicas", opts.replicas()),
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
        if args.command == "checkpoint":
            return _checkpoint_command(args)
        if args.command == "xla":
            return xla_export.command(args)
        if args.command == "stacks":
            from loom.comm.stacks import stacks_command

            return stacks_command(args.master)
        if args.command == "lighthouse":
            from loom.launch.groups import serve_lighthouse

            return serve_lighthouse(args.port, args.min_groups)
        if args.command == "doctor":
            from loom.diagnostics.doctor import doctor

            return doctor(_options(args), args.checkpoint_dir, args.wait)
        opts = _options(args)
        if args.command in ("run", "scale"):
            check_not_shadowed()
        if args.command == "scale":
            from pathlib import Path

            from loom.diagnostics.scale import parse_sizes, run_scale

            run_scale([args.script, *args.script_args], parse_sizes(args.sizes), args.steps, Path(args.out), opts)
            return 0
        if args.command == "env":
            rows = describe_environment(opts)
            width = max(len(k) for k, _ in rows)
            for key, value in rows:
                print(f"{key:<{width}}  {value}")
            return 0
        entry = (["-m"] if args.module else []) + [args.script, *args.script_args]
        check_timeouts(opts)
        if args.groups is not None or args.lighthouse or args.group is not None:
            return _groups_command(entry, opts, args)
        ps_options = JobOptions(opts.max_restarts, args.staleness, args.ps_checkpoint_dir, args.sync, args.ps_tls_cert, args.ps_tls_key, opts.threads, opts.timeout)
        if args.ps is not None:
            if args.ps_hosts or args.role:
                raise LaunchError("--ps N starts every server on this machine; across machines use --ps-hosts and --role instead")
            return run_parameter_server_job(entry, args.ps, args.workers or 0, ps_options)
        cluster = ParameterServerCluster.resolve(args.ps_hosts, args.workers, args.role, args.index)
        if cluster is not None:
            return run_parameter_server_task(entry, cluster, ps_options)
        if args.workers is not None:
            raise LaunchError("--workers is for parameter-server jobs: add --ps N (one machine) or --ps-hosts and --role (across machines)")
        return run_job(entry, opts)
    except LoomError as exc:
        print(f"loom: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
