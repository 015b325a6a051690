"""``loom scale train.py --nproc 1,2,4``: the user's own job at several sizes, and how well it scales.

Each size is launched as ``loom run`` would launch it, with ``LOOM_SCALE_STEPS`` in the
environment: the strategy's step recorder counts training steps (the first, start-up, left
out), and when it reaches that many every rank reports its breakdown, the chief writes it to
``LOOM_SCALE_REPORT``, and the workers exit 0. The script needs no change. The summary gives
samples/s against replicas, the efficiency (samples/s per replica against the smallest
size's), and the median breakdown at each size, as a table, JSON and a PNG.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from loom.diagnostics.breakdown import PARTS
from loom.errors import LaunchError

STEPS_ENV = "LOOM_SCALE_STEPS"
REPORT_ENV = "LOOM_SCALE_REPORT"


def steps_limit() -> int | None:
    """The steps a worker runs under ``loom scale`` (None outside it)."""
    value = os.environ.get(STEPS_ENV)
    return int(value) if value else None


def finish(strategy: Any) -> NoReturn:
    """In a worker: report this window on every rank, the chief writes it, and the process exits 0."""
    from loom.diagnostics.report import report

    result = report(strategy, show=False)
    if strategy.is_chief:
        path = Path(os.environ[REPORT_ENV])
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps({"replicas": strategy.num_replicas_in_sync, **result.to_dict()}))
        partial.replace(path)
    raise SystemExit(0)


def parse_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; one clear line for anything else."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise LaunchError(f"--nproc takes distinct positive process counts separated by commas, like 1,2,4; got {text!r}")
    return sorted(sizes)


def run_scale(entry: list[str], sizes: list[int], steps: int, out: Path, opts: Any) -> dict[str, Any]:
    """Launch ``entry`` at each size for ``steps`` counted steps; print, and write scale.json and scale.png in ``out``."""
    from loom.launch.torchrun import run_job

    if steps < 1:
        raise LaunchError(f"--steps must be at least 1, got {steps}")
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in sizes:
        path = out / f"nproc{n}.json"
        path.unlink(missing_ok=True)
        os.environ.update({STEPS_ENV: str(steps), REPORT_ENV: str(path)})
        try:
            code = run_job(entry, replace(opts, nproc=n))
        finally:
            os.environ.pop(STEPS_ENV, None)
            os.environ.pop(REPORT_ENV, None)
        if code != 0:
            raise LaunchError(f"the script failed at --nproc {n} (exit code {code}); its error is above")
        if not path.exists():
            raise LaunchError(
                f"the script ended before {steps + 1} training steps at --nproc {n}: give it more data or epochs, or pass a smaller --steps"
            )
        runs.append(json.loads(path.read_text()))
    summary = summarise(runs)
    (out / "scale.json").write_text(json.dumps(summary, indent=2))
    print(table(summary), flush=True)
    try:
        plot(summary, out / "scale.png")
        print(f"loom: wrote {out / 'scale.json'} and {out / 'scale.png'}", flush=True)
    except ImportError:
        print(f"loom: wrote {out / 'scale.json'}; the chart needs matplotlib: pip install matplotlib", flush=True)
    return summary


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples/s, efficiency against the smallest size, and the median ms per step of each part."""
    base = runs[0]
    per_replica = base["samples_per_sec"] / base["replicas"]
    sizes = []
    for run in runs:
        ranks = [r for r in run["ranks"] if r["steps"]]
        sizes.append({
            "replicas": run["replicas"],
            "samples_per_sec": run["samples_per_sec"],
            "efficiency": run["samples_per_sec"] / (per_replica * run["replicas"]) if per_replica else 0.0,
            "ms_per_step": {p: 1e3 * statistics.median(r["seconds"][p] for r in ranks) for p in (*PARTS, "total")},
            "verdict": run["verdict"]["message"],
        })  # fmt: skip
    return {"sizes": sizes}


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'replicas':>8}{'samples/s':>12}{'efficiency':>12}" + "".join(f"{p:>10}" for p in (*PARTS, "total")) + "   (ms per step)"]
    for s in summary["sizes"]:
        parts = "".join(f"{s['ms_per_step'][p]:>10.2f}" for p in (*PARTS, "total"))
        lines.append(f"{s['replicas']:>8}{s['samples_per_sec']:>12,.0f}{s['efficiency']:>12.0%}{parts}")
    for s in summary["sizes"]:
        lines.append(f"{s['replicas']} replica(s): {s['verdict']}")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Samples/s against replicas beside ideal scaling, and the breakdown at each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = summary["sizes"]
    replicas = [s["replicas"] for s in sizes]
    rates = [s["samples_per_sec"] for s in sizes]
    ideal = [rates[0] / replicas[0] * n for n in replicas]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(replicas, ideal, "--", color="grey", label="ideal")
    left.plot(replicas, rates, "o-", label="measured")
    for n, rate, s in zip(replicas, rates, sizes):
        left.annotate(f"{s['efficiency']:.0%}", (n, rate), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    left.set_xlabel("replicas")
    left.set_ylabel("samples/s")
    left.set_xticks(replicas)
    left.legend()
    bottom = [0.0] * len(sizes)
    labels = [str(n) for n in replicas]
    for part in PARTS:
        values = [s["ms_per_step"][part] for s in sizes]
        right.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xlabel("replicas")
    right.set_ylabel("ms per step (median rank)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
