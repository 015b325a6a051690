"""A parameter-server process: ``python -m loom.strategies.parameter_server.serve --port P``.

The job's token comes from ``LOOM_PS_TOKEN`` (not the command line, where other users of the
machine could read it). With ``--checkpoint FILE`` the server logs every change before it
acknowledges it (``FILE.log.<n>``, see ``wal.py``) and snapshots its state to FILE every
``--checkpoint-every`` seconds and on SIGTERM; a server started again, even after ``kill -9``,
resumes from the snapshot and the log with every update a worker saw acknowledged, each applied
once. If a worker has seen more than it came back with (its files were removed or damaged),
it writes the count to ``FILE.lost`` (JSON), refuses every request and exits with code
``LOST_UPDATES``; its launcher stops the job. Told that another task failed the job
(``job_failure.py``), it refuses the workers' requests with that reason until every worker
is done or ``GRACE`` seconds pass, writes the reason to ``FILE.failed`` and exits with ``JOB_FAILED``. A snapshot that takes long (a large shard) spaces the next ones out, so
that saving stays under 1/``SAVE_SHARE`` of the server's time instead of keeping a core busy and
the variables locked (the log grows meanwhile). With
``--workers M`` it exits once every worker's launcher has said that worker is done for good;
``--restarted`` (a restart within the same run) keeps what it knew of that from its checkpoint.
With ``LOOM_PS_TLS_CERT`` and ``LOOM_PS_TLS_KEY`` (PEM files) it accepts TLS connections only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from loom.errors import LoomError
from loom.strategies.parameter_server.job_failure import GRACE, JOB_FAILED
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.state_file import lost_message
from loom.strategies.parameter_server.transport import TLS, message_limit

SAVE_SHARE = 20  # a save waits at least this many times as long as the last one took
LOST_UPDATES = 3  # exit code: a worker saw updates this server no longer has


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--index", type=int, default=0, help="this server's number in the job, for messages")
    parser.add_argument("--checkpoint", help="file to save the server's state to, and resume from")
    parser.add_argument("--checkpoint-every", type=float, default=10.0, help=f"seconds between saves (at least {SAVE_SHARE}x the last save's time)")
    parser.add_argument("--workers", type=int, help="exit once this many workers (and any that joined) have finished")
    parser.add_argument("--restarted", action="store_true", help="a restart within this run: keep which workers finished")
    args = parser.parse_args(argv)
    token = os.environ.get("LOOM_PS_TOKEN")
    if not token:
        print("loom: error: LOOM_PS_TOKEN is not set; a parameter server only serves its own job", file=sys.stderr)
        return 2
    try:
        tls = TLS.from_env(server=True)
        message_limit()  # a bad bound is one line now, not gRPC's traceback when serving
    except LoomError as error:
        print(f"loom: error: {error}", file=sys.stderr)
        return 2
    try:
        server, resumed = ParameterServer.recover(token, args.checkpoint) if args.checkpoint else (ParameterServer(token), "")
    except LoomError as error:
        print(f"loom: error: parameter server {args.index}: {error}", file=sys.stderr)
        return 2
    if not args.restarted:
        server.new_run()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        port = server.serve(args.port, args.host, workers=args.workers, tls=tls)
    except LoomError as error:
        print(f"loom: error: parameter server {args.index}: {error}", file=sys.stderr)
        return 2
    state = f" (resumed from {args.checkpoint}: {resumed})" if resumed else ""
    print(f"loom: parameter server {args.index} listening on {args.host}:{port}{' with TLS' if tls else ''}{state}", flush=True)
    next_save = time.monotonic() + args.checkpoint_every
    failed_at = None
    while not stop.wait(0.2):
        if server.lost is not None:
            return _stop_lost(server, args.index)
        if server.failed is not None:
            failed_at = failed_at or time.monotonic()
            if server.all_finished(args.workers or 0) or time.monotonic() - failed_at > GRACE:
                return _stop_failed(server, args)
        if args.workers and server.all_finished(args.workers):
            print(f"loom: parameter server {args.index}: every worker has finished; exiting", flush=True)
            break
        if args.checkpoint and server.created and time.monotonic() >= next_save:
            started = time.thread_time()  # the save's own work: not the wait for an update to release the variables
            server.save(args.checkpoint)
            next_save = time.monotonic() + save_interval(args.checkpoint_every, time.thread_time() - started)
    if args.checkpoint and server.created:
        server.save(args.checkpoint)
    server.stop()
    return 0


def _stop_lost(server: ParameterServer, index: int) -> int:
    """Stop without saving: the files stay as they were found."""
    server.stop()
    print(f"loom: parameter server {index} {lost_message(dict(server.lost or {}))}", file=sys.stderr, flush=True)
    return LOST_UPDATES


def _stop_failed(server: ParameterServer, args: argparse.Namespace) -> int:
    """Stop, saving what it holds, and leave the reason where the launcher reads it (``FILE.failed``)."""
    if args.checkpoint and server.created:
        server.save(args.checkpoint)
    server.stop()
    if args.checkpoint:
        with open(f"{args.checkpoint}.failed", "w") as report:
            report.write(server.failed or "")
    print(f"loom: parameter server {args.index} stops: the job failed: {server.failed}", file=sys.stderr, flush=True)
    return JOB_FAILED


def save_interval(every: float, took: float) -> float:
    """Seconds until the next save: ``every``, or longer after a save that took ``took`` seconds."""
    return max(every, SAVE_SHARE * took)


if __name__ == "__main__":
    sys.exit(main())
