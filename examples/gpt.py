"""Train the small byte-level GPT on the standard library's source under any strategy.

    python examples/gpt.py --strategy tensor_parallel        # launches itself on 2 processes
    python examples/gpt.py --strategy hybrid --mesh dp=2,tp=2
    python examples/gpt.py --all --plot runs/gpt/loss.png    # every strategy, all curves in one PNG

Every strategy reads the same global batches from the same initial weights, so each step's
loss is the same up to float reassociation: ``--all`` prints how far each curve is from
one device's and exits non-zero when one is further than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.data import Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import loom  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, next_byte_loss, splits  # noqa: E402

# Each strategy with the processes it runs on and its options; the same model and batches for all.
SETUPS: dict[str, tuple[int, dict]] = {
    "one_device": (1, {}),
    "mirrored": (2, {}),
    "sharded": (2, {}),
    "pipeline": (2, {"stages": 2, "microbatches": 4}),
    "tensor_parallel": (2, {}),
    "hybrid": (4, {"mesh": {"dp": 2, "tp": 2}}),
}


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=2,tp=2`` as ``{"dp": 2, "tp": 2}``."""
    try:
        return {name: int(degree) for name, degree in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--mesh takes axis=degree pairs separated by commas, like dp=2,tp=2; got {text!r}") from None


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=list(SETUPS), default="one_device")
    parser.add_argument("--mesh", type=parse_mesh, help="hybrid's mesh, e.g. dp=2,pp=2 (default dp=2,tp=2)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32, help="global batch of 64-byte windows")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-windows", type=int, default=512, help="validation windows scored (the held-out tail of the text)")
    parser.add_argument("--curve", help="write the chief's per-step losses and validation loss to this JSON file")
    parser.add_argument("--all", action="store_true", help="run every strategy and compare their curves")
    parser.add_argument("--plot", default="runs/gpt/loss.png", help="with --all: the PNG of every loss curve")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="with --all: largest loss difference allowed")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    """One process's part of a run; the chief prints the validation loss and writes the curve."""
    setup = dict(SETUPS[args.strategy][1])
    if args.strategy == "hybrid" and args.mesh:
        setup["mesh"] = args.mesh
    strategy = loom.get_strategy(args.strategy, **setup)
    config = GPTConfig()
    train_set, val_set = splits(config.context)
    val_set = Subset(val_set, range(min(args.val_windows, len(val_set))))
    torch.manual_seed(0)  # every process builds the same initial weights
    model, opt = strategy.prepare(GPT(config), lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.1))
    step = strategy.train_step(model, next_byte_loss, opt, max_grad_norm=1.0)
    losses: list[float] = []
    loader = strategy.distribute(train_set, batch_size=args.batch, seed=0)
    while len(losses) < args.steps:
        for x, y in loader:
            losses.append(float(strategy.reduce(step(x, y))))  # the global batch's loss
            if len(losses) % 20 == 0:
                strategy.print(f"step {len(losses)}: loss {losses[-1]:.4f}")
            if len(losses) == args.steps:
                break
    val_loss = validation_loss(strategy, model, val_set, args.batch)
    strategy.print(f"{type(strategy).__name__}: validation loss {val_loss:.4f} after {args.steps} steps")
    if args.curve and strategy.is_chief:
        Path(args.curve).write_text(json.dumps({"strategy": args.strategy, "losses": losses, "val_loss": val_loss}))


@torch.no_grad()
def validation_loss(strategy: loom.Strategy, model: torch.nn.Module, data: Subset, batch: int) -> float:
    """Mean loss over the held-out windows, in whole global batches (a pipeline runs them stage by stage)."""
    model.eval()
    losses = [float(strategy.reduce(next_byte_loss(model(x), y))) for x, y in strategy.distribute(data, batch_size=batch, shuffle=False, drop_last=True)]
    model.train()
    return sum(losses) / len(losses)


def run_all(args: argparse.Namespace) -> int:
    """Every strategy as its own job, then one plot and the largest difference from one device."""
    out = Path(args.plot).parent
    out.mkdir(parents=True, exist_ok=True)
    curves = {}
    for name in SETUPS:
        curve = out / f"{name}.json"
        command = [sys.executable, __file__, "--strategy", name, "--steps", str(args.steps), "--batch", str(args.batch),
                   "--lr", str(args.lr), "--val-windows", str(args.val_windows), "--curve", str(curve)]  # fmt: skip
        if name == "hybrid" and args.mesh:
            command += ["--mesh", ",".join(f"{k}={v}" for k, v in args.mesh.items())]
        done = subprocess.run(command)  # launches itself on the processes it needs
        if done.returncode:
            print(f"{name}: the run failed (exit {done.returncode}); see its output above", flush=True)
            continue
        curves[name] = json.loads(curve.read_text())
    reference = curves.get("one_device")
    worst = 0.0
    for name, got in curves.items():
        if reference and name != "one_device":
            gap = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"]))
            worst = max(worst, gap)
            print(f"{name:>16}: validation loss {got['val_loss']:.4f}, largest step-loss difference from one device {gap:.2e}")
    plot(curves, Path(args.plot))
    print(f"loss curves: {args.plot}")
    return int(len(curves) < len(SETUPS) or worst > args.tolerance)


def plot(curves: dict[str, dict], path: Path) -> None:
    """Every strategy's loss curve, and beside it each one's distance from one device's at every step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(13, 5))
    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))]
    reference = curves.get("one_device", {}).get("losses")
    for (name, got), style in zip(curves.items(), styles):
        steps = range(1, len(got["losses"]) + 1)
        ax.plot(steps, got["losses"], linestyle=style, label=f"{name} (val {got['val_loss']:.3f})")
        if reference and name != "one_device":
            gap.plot(steps, [max(abs(a - b), 1e-9) for a, b in zip(got["losses"], reference)], linestyle=style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("Small GPT on the standard library's source")
    ax.legend()
    gap.set_yscale("log")
    gap.set_xlabel("step")
    gap.set_ylabel("|loss - one device's loss| (1e-9 where equal)")
    gap.set_title("Distance from one device, step by step")
    gap.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = options()
    if args.all:
        raise SystemExit(run_all(args))
    nproc = math.prod(args.mesh.values()) if args.strategy == "hybrid" and args.mesh else SETUPS[args.strategy][0]
    if nproc == 1:
        train(args)
    else:
        loom.launch(lambda: train(args), nproc=nproc)


if __name__ == "__main__":
    main()
