"""A parameter-server process: ``python -m loom.strategies.parameter_server.serve --port P``.

The job's token comes from ``LOOM_PS_TOKEN`` (not the command line, where other users of the
machine could read it). It serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from loom.strategies.parameter_server.server import ParameterServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--index", type=int, default=0, help="this server's number in the job, for messages")
    args = parser.parse_args(argv)
    token = os.environ.get("LOOM_PS_TOKEN")
    if not token:
        print("loom: error: LOOM_PS_TOKEN is not set; a parameter server only serves its own job", file=sys.stderr)
        return 2
    server = ParameterServer(token)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    port = server.serve(args.port, args.host)
    print(f"loom: parameter server {args.index} listening on {args.host}:{port}", flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
