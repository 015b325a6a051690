"""PipelineStrategy's checks that need two processes, in one launched job; each process saves its results.

    loom run --nproc 2 pipeline_job.py --dir DIR

DIR/one must hold OneDevice's checkpoint of ``model()`` (written by the test). Results go to
DIR/results-<rank>.pt; the pipeline's checkpoint to DIR/pipeline.
"""

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import loom
from examples.gpt_model import GPT, GPTConfig, next_byte_loss
from tests.contract.models import ModelOutput

CONFIG = GPTConfig(context=8, width=16, heads=2, layers=4)
BATCH = 8


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def batches(n: int, size: int = BATCH, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, CONFIG.vocab, (size, CONFIG.context), generator=g) for _ in range(2)) for _ in range(n)]


class NanoGPT(nn.Module):
    """nanoGPT's layout: blocks in ``transformer.h``, a ModuleList inside a ModuleDict; ``(logits, None)`` out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        reference = GPT(CONFIG)
        self.transformer = nn.ModuleDict({"wte": reference.embed, "wpe": reference.pos, "h": reference.blocks, "ln_f": reference.ln_f})
        self.lm_head = reference.head

    def forward(self, idx: torch.Tensor):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)), None


def nano_loss(out, targets):
    return next_byte_loss(out[0], targets)


class Transformer(nn.Module):
    """nanoGPT's ``transformer``, holding a parameter and a buffer of its own besides its modules."""

    def __init__(self, reference: GPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.h, self.ln_f = reference.embed, reference.pos, reference.blocks, reference.ln_f
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, CONFIG.width))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, CONFIG.width))


class OwnLossGPT(nn.Module):
    """``forward(idx, targets)`` computes the loss, as language models do, into a ``ModelOutput``;
    ``transformer`` holds tensors of its own, used before the blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        reference = GPT(CONFIG)
        self.transformer = Transformer(reference)
        self.lm_head = reference.head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        t = self.transformer
        x = t.wte(idx) * t.scale + t.wpe(torch.arange(idx.shape[1])) + t.shift
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        loss = next_byte_loss(logits, targets) if targets is not None else None
        return ModelOutput(logits=logits, loss=loss)


def logits_loss(out, targets):
    return next_byte_loss(out.logits, targets)  # read by attribute: the output kept its class


class Counter(nn.Module):
    """Counts its forward calls in training in a buffer, as BatchNorm counts its batches."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return x


def mine(prepared) -> dict:
    """This stage's trained tensors by their names in the model (the others are another process's)."""
    return {k: v.detach().clone() for k, v in loom.unwrap(prepared).state_dict().items() if not v.is_meta}


def train(strategy, steps: int, build=model, loss=next_byte_loss, **step_options):
    prepared, opt = strategy.prepare(build(), adamw)
    step = strategy.train_step(prepared, loss, opt, **step_options)
    losses = [float(step(x, y)) for x, y in batches(steps)]
    return prepared, opt, step, losses


def after_fit(strategy, directory: Path) -> dict:
    """``fit``, then ``save`` and ``restore`` with the module the user passed (other stages' tensors meta there)."""
    gpt = model()
    data = TensorDataset(*(torch.cat(parts) for parts in zip(*batches(2))))
    loom.fit(gpt, next_byte_loss, adamw, data, batch_size=BATCH, shuffle=False, strategy=strategy, progress=False)
    strategy.save(directory, step=2, model=gpt)
    again = model()
    strategy.prepare(again, adamw)
    strategy.restore(directory, model=again)
    return {"fitted": mine(gpt), "restored": mine(again)}


def from_nothing(strategy, directory: Path) -> dict:
    """``restore`` of an empty directory at the start, then two AdamW steps."""
    prepared, opt = strategy.prepare(model(), adamw)
    directory.mkdir(exist_ok=True)
    returned = strategy.restore(directory, model=prepared, optimizer=opt)
    step = strategy.train_step(prepared, next_byte_loss, opt)
    for x, y in batches(2):
        step(x, y)
    return {"returned": returned, "weights": mine(prepared), "adam_steps": sorted({int(v["step"]) for v in opt.state_dict()["state"].values()})}


def compiled(strategy, first: bool, directory: Path) -> dict:
    """Two steps of ``torch.compile(model)`` given to ``prepare`` (``first``), or of ``torch.compile(prepare(...))``;
    then saved with what the user holds. The backend records the graphs it was given."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    if first:
        user = torch.compile(model(), backend=backend)
        prepared, opt = strategy.prepare(user, adamw)
    else:
        prepared, opt = strategy.prepare(model(), adamw)
        prepared = user = torch.compile(prepared, backend=backend)
    step = strategy.train_step(prepared, next_byte_loss, opt)
    for x, y in batches(2):
        step(x, y)
    with torch.no_grad():
        outputs = prepared(batches(1, size=3, seed=4)[0][0])  # inference, stage after stage
    strategy.save(directory, step=2, model=user, optimizer=opt)
    return {"weights": mine(prepared), "graphs": len(graphs), "outputs": outputs.shape}


def uneven_epoch(strategy):
    """One epoch of 19 samples in global batches of 8, clipped: the last batch holds 3."""
    prepared, opt = strategy.prepare(model(), adamw)
    step = strategy.train_step(prepared, next_byte_loss, opt, max_grad_norm=0.5)
    data = TensorDataset(*(torch.cat(parts)[: 2 * BATCH + 3] for parts in zip(*batches(3, seed=11))))
    losses, rows = [], []
    for x, y in strategy.distribute(data, batch_size=BATCH, shuffle=False):
        losses.append(float(step(x, y)))
        rows.append(step.outputs.shape[0])
    return prepared, {"losses": losses, "rows": rows}


def error_of(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the line is the result
        return f"{type(error).__name__}: {error}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    directory = Path(parser.parse_args().dir)
    results: dict = {}

    # 10 AdamW steps, clipped, against OneDevice on the same global batches
    one_model, _, one_step, one_losses = train(loom.OneDeviceStrategy(), 10, max_grad_norm=0.5)
    strategy = loom.PipelineStrategy(stages=2, microbatches=4, timeout=60)
    prepared, opt, step, losses = train(strategy, 10, max_grad_norm=0.5)
    reference = one_model.state_dict()
    results["gpt"] = {
        "weights": mine(prepared),
        "reference": {k: reference[k] for k in mine(prepared)},
        "losses": losses,
        "reference_losses": one_losses,
        "outputs": step.outputs.shape,
        "eval_difference": _eval_difference(prepared, one_model),
        "evaluate": [loom.evaluate(m, next_byte_loss, TensorDataset(*batches(1, seed=5)[0]), batch_size=BATCH, strategy=s)["loss"]
                     for m, s in ((prepared, strategy), (one_model, loom.OneDeviceStrategy()))],
    }
    # an epoch whose last batch is short (19 samples in batches of 8): that batch runs stage after stage
    results["uneven"] = {}
    one_uneven, one_got = uneven_epoch(loom.OneDeviceStrategy())
    for name, uneven in {"1f1b": strategy, "zbv": loom.PipelineStrategy(schedule="zbv_zero_bubble", virtual_stages=2, timeout=60)}.items():
        prepared_uneven, got = uneven_epoch(uneven)
        reference_uneven = one_uneven.state_dict()
        results["uneven"][name] = {"weights": mine(prepared_uneven), "reference": {k: reference_uneven[k] for k in mine(prepared_uneven)}, **got}
    results["uneven"]["reference_losses"] = one_got["losses"]

    x, y = batches(1, seed=7)[0]
    unbuilt, unbuilt_opt = strategy.prepare(model(), adamw)
    first_step = strategy.train_step(unbuilt, next_byte_loss, unbuilt_opt)  # its schedule is built at the first step
    results["errors"] = {
        "shape": error_of(lambda: step(x[:, :4], y[:, :4])),
        "microbatches": error_of(lambda: first_step(x[:6], y[:6])),
        "eager": error_of(lambda: prepared(x)),
        "fast_path": error_of(lambda: strategy.prepare(model(), fast_path=True, example_input=x)),
        "batchnorm": error_of(lambda: strategy.prepare(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))),
    }
    strategy.save(directory / "pipeline", step=10, model=prepared, optimizer=opt)
    fresh, fresh_opt = strategy.prepare(model(), adamw)
    strategy.restore(directory / "pipeline", model=fresh, optimizer=fresh_opt)  # a pipeline's own checkpoint
    again, again_opt = strategy.prepare(model(), adamw)
    strategy.restore(directory / "one", model=again, optimizer=again_opt)  # OneDevice's
    results["restore"] = {
        "own": mine(fresh),
        "own_state": {k: v["exp_avg"].clone() for k, v in fresh_opt.state_dict()["state"].items()},
        "saved_state": {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()},
        "lr": fresh_opt.param_groups[0]["lr"],
        "one_device": mine(again),
        "one_device_steps": sorted({int(v["step"]) for v in again_opt.state_dict()["state"].values()}),
    }

    built = model()
    kept, built_opt = strategy.prepare(built, torch.optim.SGD(built.parameters(), lr=0.1))  # a built optimizer, not a factory
    held = [p for p in built.parameters() if not p.is_meta]
    results["built_optimizer"] = {
        "held": len(held),
        "in_optimizer": [id(p) for g in built_opt.param_groups for p in g["params"]] == [id(p) for p in held],
        "meta": sum(1 for p in built.parameters() if p.is_meta),
    }

    balanced = loom.PipelineStrategy(balance="time", example_inputs=x, timeout=60)
    results["time_balance"] = balanced.prepare(model()).runner.bounds  # measured by the first process, used by both

    # replicated pipelines (a hybrid's dp axis): here two pipelines of one stage, each reading half the batch
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    replicated = loom.PipelineStrategy(microbatches=2, group=alone[dist.get_rank()], dp_group=dist.group.WORLD, timeout=60)
    one_model, _, _, _ = train(loom.OneDeviceStrategy(), 2)
    twice, twice_opt = replicated.prepare(model(), adamw)
    twice_step = replicated.train_step(twice, next_byte_loss, twice_opt)
    data = TensorDataset(*(torch.cat(parts) for parts in zip(*batches(2))))
    for inputs, targets in replicated.distribute(data, batch_size=BATCH, shuffle=False):  # the same global batches
        twice_step(inputs, targets)
    results["replicated"] = {
        "replicas": replicated.num_replicas_in_sync,
        "replica": replicated.replica_id,
        "rows": twice_step.outputs.shape[0],
        "difference": max((v - one_model.state_dict()[k]).abs().max().item() for k, v in mine(twice).items()),
        "reduced": replicated.reduce(replicated.replica_id + 1, "sum"),
    }

    # every schedule: the first step's loss is the unpipelined loss, two steps equal OneDevice's
    one, _, _, one_losses = train(loom.OneDeviceStrategy(), 2)
    results["schedules"] = {}
    for name, virtual in [("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2), ("zbv_zero_bubble", 2)]:
        pipelined, _, _, losses = train(loom.PipelineStrategy(schedule=name, virtual_stages=virtual, microbatches=4, timeout=60), 2)
        weights = mine(pipelined)
        results["schedules"][name] = {
            "loss_difference": abs(losses[0] - one_losses[0]),
            "weight_difference": max((v - one.state_dict()[k]).abs().max().item() for k, v in weights.items()),
        }
    results["seams"] = seams(directory)
    torch.save(results, directory / f"results-{dist.get_rank()}.pt")


def seams(directory: Path) -> dict:
    """Real models' shapes: nested blocks, outputs with None, buffers, compile, fit then save, restore of nothing."""
    one_nano, _, _, one_losses = train(loom.OneDeviceStrategy(), 2, NanoGPT, nano_loss)
    nano_results = {}
    for name, split in {"auto": None, "dotted": ["transformer.h.3"]}.items():
        nano, _, _, losses = train(loom.PipelineStrategy(split_points=split, timeout=60), 2, NanoGPT, nano_loss)
        nano_results[name] = {"weights": mine(nano), "reference": one_nano.state_dict(), "losses": losses, "bounds": nano.runner.bounds}
    nano_results["reference_losses"] = one_losses

    counter = Counter()
    counted, counted_opt = loom.PipelineStrategy(split_points=["1"], timeout=60).prepare(nn.Sequential(nn.Linear(4, 4), counter, nn.Linear(4, 2)), adamw)
    counted_step = counted.strategy.train_step(counted, torch.nn.functional.cross_entropy, counted_opt)
    for _ in range(2):  # two steps of 2 micro-batches: 4 calls, and none from the shape inference
        counted_step(torch.randn(BATCH, 4), torch.randint(0, 2, (BATCH,)))

    strategy = loom.PipelineStrategy(timeout=60)
    hybrid = loom.HybridStrategy(mesh={"pp": 2}, timeout=60)
    return {
        "nano": nano_results,
        "own_loss": own_loss(),
        "counted": None if counter.calls.is_meta else int(counter.calls),
        "compiled": {f"{name}_{order}": compiled(s, order == "before", directory / f"compiled_{name}_{order}")
                     for name, s in {"pipeline": strategy, "hybrid": hybrid}.items() for order in ("before", "after")},
        "after_fit": {"pipeline": after_fit(strategy, directory / "after_fit"), "hybrid": after_fit(hybrid, directory / "hybrid_after_fit")},
        "from_nothing": from_nothing(hybrid, directory / "nothing"),
    }


def own_loss() -> dict:
    """``OwnLossGPT``: its ``ModelOutput`` kept through the stages, the step and inference (read by attribute);
    ``transformer``'s own tensors kept by the first stage; its own loss (``train_step(model, None, opt)``) under
    1F1B with 4 micro-batches and under ZBV (the first and last stages on one process), and in ``evaluate``."""
    one, _, _, reference_losses = train(loom.OneDeviceStrategy(), 2, OwnLossGPT, None)
    data = TensorDataset(*batches(1, seed=5)[0])
    got: dict = {"reference": one.state_dict(), "reference_losses": reference_losses,
                 "reference_evaluate": loom.evaluate(one, None, data, batch_size=BATCH, strategy=loom.OneDeviceStrategy())["loss"]}  # fmt: skip
    strategies = {
        "loss_fn": (loom.PipelineStrategy(timeout=60), logits_loss),
        "1f1b": (loom.PipelineStrategy(microbatches=4, timeout=60), None),
        "zbv": (loom.PipelineStrategy(schedule="zbv_zero_bubble", virtual_stages=2, timeout=60), None),
    }
    for name, (strategy, loss) in strategies.items():
        prepared, _, step, losses = train(strategy, 2, OwnLossGPT, loss)
        with torch.no_grad():
            inferred = prepared(batches(1, size=3, seed=4)[0][0])
        got[name] = {
            "weights": mine(prepared),
            "losses": losses,
            "step_outputs": (type(step.outputs).__name__, step.outputs.logits.shape),
            "inferred": (type(inferred).__name__, inferred.logits.shape),
            "evaluate": loom.evaluate(prepared, loss, data, batch_size=BATCH, strategy=strategy)["loss"],
        }
    return got


@torch.no_grad()
def _eval_difference(prepared, reference) -> float:
    x, _ = batches(1, size=5, seed=3)[0]  # any batch size: inference runs stage after stage
    prepared.eval()
    out = prepared(x)
    prepared.train()
    return (out - reference(x)).abs().max().item()


if __name__ == "__main__":
    loom.launch(main)
