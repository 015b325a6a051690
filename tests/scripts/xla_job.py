"""Every TPUStrategy check that needs JAX, in one process with 8 virtual XLA CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python xla_job.py DIR

DIR/reference must hold OneDevice's checkpoint (tests/contract/cases.save_reference). Each
check runs OneDevice on the same global batches beside TPUStrategy; the results (tensors and
plain values) go to DIR/results.pt for tests/strategies/test_xla.py to assert on. JAX's import
and each compile are the expensive part, so the models and steps are tiny.
"""

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.launch import cli
from loom.strategies.xla.export import export_step
from tests.contract.cases import GLOBAL_BATCH, adamw, data, mlp, sgd, weights

SCRIPTS = Path(__file__).resolve().parent


def cnn() -> nn.Module:
    """No bias before BatchNorm: its true gradient is 0, and Adam would amplify the rounding noise."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def images(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, (x[:, 0, :4].mean((1, 2)) > 0).long())


def train(strategy: loom.Strategy, model: Callable[[], nn.Module], optimizer: Callable, dataset: TensorDataset, schedule: bool = False, **step_options: Any) -> dict[str, Any]:
    net, opt = strategy.prepare(model(), optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    step = strategy.train_step(net, F.cross_entropy, opt, scheduler=scheduler, **step_options)
    losses, norms = [], []
    for x, y in strategy.distribute(dataset, batch_size=GLOBAL_BATCH, shuffle=False):
        losses.append(float(step(x, y)))
        if step.grad_norm is not None:
            norms.append(float(step.grad_norm))
    net.eval()
    with torch.no_grad():  # an eager forward: evaluation on the trained weights, brought back from the devices
        evaluated = net(dataset.tensors[0][:8])
    return {"weights": weights(net), "lr": opt.param_groups[0]["lr"], "losses": losses, "norms": norms, "eval": evaluated, "step": step}


def compare(make: Callable[..., loom.Strategy], *args: Any, **kwargs: Any) -> dict[str, Any]:
    xla = train(make(), *args, **kwargs)
    one = train(loom.OneDeviceStrategy(), *args, **kwargs)
    return {"xla": {k: v for k, v in xla.items() if k != "step"}, "one": {k: v for k, v in one.items() if k != "step"}, "step": xla["step"]}


class Output(dict):
    """An output object: a dict read by attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class OwnLoss(nn.Module):
    """``forward(x, targets)`` computes the loss: ``(logits, loss)`` as nanoGPT's, or an ``Output``."""

    def __init__(self, as_object: bool = False) -> None:
        super().__init__()
        self.net, self.as_object = mlp(), as_object

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        logits = self.net(x)
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return Output(logits=logits, loss=loss) if self.as_object else (logits, loss)


def own_loss(strategy: loom.Strategy, as_object: bool = False) -> dict[str, Any]:
    """The model's own loss through ``train_step(model, None, opt, accumulate=2)``: weights and the last outputs' class."""
    net, opt = strategy.prepare(OwnLoss(as_object), sgd)
    step = strategy.train_step(net, None, opt, accumulate=2)
    for x, y in strategy.distribute(data(), batch_size=GLOBAL_BATCH, shuffle=False):
        step(x, y)
    return {"weights": weights(net), "outputs": (type(step.outputs).__name__, tuple(step.outputs.logits.shape) if as_object else None)}


def padded(dataset: TensorDataset, devices: int) -> TensorDataset:
    """loom's uneven-last-batch policy written out: the last batch's first samples repeated."""
    x, y = dataset.tensors
    full = len(x) // GLOBAL_BATCH * GLOBAL_BATCH
    m = len(x) - full
    index = torch.cat([torch.arange(full), full + torch.arange(-(-m // devices) * devices) % m])
    return TensorDataset(x[index], y[index])


def main() -> None:
    directory = Path(sys.argv[1])
    out: dict[str, Any] = {"jax_with_loom": "jax" in sys.modules}  # before any strategy was created
    tpu = loom.get_strategy("tpu")
    out["names"] = [type(loom.get_strategy(n)).__name__ for n in ("tpu", "xla")]
    out["replicas"] = (tpu.num_replicas_in_sync, tpu.data_parallel_size, tpu.num_hosts, tpu.replica_id)

    # equivalence with OneDevice: MLP and CNN (BatchNorm statistics carried through the step)
    for name, model, dataset in (("mlp", mlp, data()), ("cnn", cnn, images())):
        sgd_run = compare(loom.TPUStrategy, model, sgd, dataset)
        out[f"{name}_sgd"] = {k: sgd_run[k] for k in ("xla", "one")}
        if name == "cnn":  # the MLP's AdamW and StepLR are tests/contract's adamw_weight_decay and step_lr
            out["cnn_adamw_steplr"] = {k: v for k, v in compare(loom.TPUStrategy, model, adamw, dataset, schedule=True).items() if k != "step"}
            step = sgd_run["step"]
            x, y = dataset[:GLOBAL_BATCH]
            program, args = step.program(x, y)
            lowered = program.lower(*args)
            out["hlo_all_reduce"] = "all-reduce" in lowered.compile().as_text()
            out["stablehlo_sharded"] = "sharding" in lowered.as_text()
            export_step(step, x, y, directory / "export", platforms=("tpu", "cpu"))

    # a model axis: large weights split over it; the same parameters as pure data parallelism
    hybrid = lambda: loom.TPUStrategy(mesh={"data": 4, "model": 2}, shard_threshold=64)  # noqa: E731
    run = compare(hybrid, mlp, sgd, data())
    out["model_axis"] = {"xla": run["xla"], "dp": out["mlp_sgd"]["xla"]}
    out["model_axis_specs"] = {n: str(a.sharding.spec) for n, a in run["step"].state.params.items()}

    # bf16-mixed: convolutions run in bfloat16 too (the contract checks linear layers against OneDevice)
    convolved: list[str] = []

    def hooked_cnn() -> nn.Module:
        net = cnn()
        net[0].register_forward_hook(lambda m, a, o: convolved.append(str(o.dtype)))
        return net

    train(loom.TPUStrategy(precision="bf16-mixed"), hooked_cnn, sgd, images(16))
    out["bf16_conv_dtypes"] = sorted(set(convolved))

    # uneven last batch (44 = 2 x 16 + 12): 12 samples padded to 16 over 8 devices, as 8 replicas would
    uneven = data(44)
    loader = tpu.distribute(uneven, batch_size=GLOBAL_BATCH, shuffle=False)
    out["valid_counts"] = [loader.valid_count(k) for k in range(len(loader))]
    run = train(loom.TPUStrategy(), mlp, sgd, uneven)
    reference = train(loom.OneDeviceStrategy(), mlp, sgd, padded(uneven, 8))
    out["uneven"] = {"xla": run["weights"], "one": reference["weights"]}

    # the feed: device copies split over data, made ahead; the position counts what the loop took
    feed = iter(loader)
    x, _ = next(feed)
    copy = getattr(x, "_loom_xla_copy")
    out["feed"] = {"spec": str(copy.sharding.spec), "devices": len(copy.sharding.device_set), "position": loader.state_dict()["batch"]}
    feed.close()

    # parameters() after steps: the trained values, read before anything else brought them back
    strategy = loom.TPUStrategy()
    net, opt = strategy.prepare(mlp(), sgd)
    step = strategy.train_step(net, F.cross_entropy, opt)
    for x, y in strategy.distribute(data(), batch_size=GLOBAL_BATCH, shuffle=False):
        step(x, y)
    out["parameters_read"] = {n: p.detach().clone() for n, p in zip(dict(mlp().named_parameters()), net.parameters())}

    # a model that computes its own loss; accumulate() has no eager loop to count here
    out["own_loss"] = {"xla": own_loss(loom.TPUStrategy())["weights"], "one": own_loss(loom.OneDeviceStrategy())["weights"]}
    out["own_loss_object"] = own_loss(loom.TPUStrategy(precision="bf16-mixed"), as_object=True)["outputs"]
    try:
        tpu.accumulate(2)
    except RuntimeError as error:
        out["accumulate_error"] = str(error)

    # no eager backward
    try:
        tpu.backward(torch.zeros((), requires_grad=True))
    except RuntimeError as error:
        out["backward_error"] = str(error)
    try:
        tpu.prepare(mlp(), sgd, fast_path=True, example_input=torch.zeros(2, 4))
    except ValueError as error:
        out["fast_path_error"] = str(error)

    # checkpoints: saved here, restored under OneDevice (by the test), and OneDevice's restored here
    strategy = loom.TPUStrategy()
    net, opt = strategy.prepare(mlp(), sgd)
    step = strategy.train_step(net, F.cross_entropy, opt)
    for x, y in strategy.distribute(data(), batch_size=GLOBAL_BATCH, shuffle=False):
        step(x, y)
    strategy.save(directory / "saved", step=3, model=net, optimizer=opt)
    out["saved"] = weights(net)
    fresh, fresh_opt = strategy.prepare(mlp(), sgd)
    fresh_step = strategy.train_step(fresh, F.cross_entropy, fresh_opt)
    x, y = data()[:GLOBAL_BATCH]
    fresh_step(x, y)  # trained on the devices first: the restore must replace that
    strategy.restore(directory / "reference", model=fresh, optimizer=fresh_opt)
    out["restored"] = weights(fresh)
    out["restored_momentum"] = {k: v["momentum_buffer"].clone() for k, v in fresh_opt.state_dict()["state"].items()}
    fresh_step(*data()[GLOBAL_BATCH : 2 * GLOBAL_BATCH])
    out["after_restore"] = weights(fresh)
    one = loom.OneDeviceStrategy()
    ref, ref_opt = one.prepare(mlp(), sgd)
    one.restore(directory / "reference", model=ref, optimizer=ref_opt)
    one.train_step(ref, F.cross_entropy, ref_opt)(*data()[GLOBAL_BATCH : 2 * GLOBAL_BATCH])
    out["after_restore_one"] = weights(ref)

    # `loom xla export`, in this process (JAX already has its 8 devices)
    out["cli_export"] = cli.main(["xla", "export", str(SCRIPTS / "xla_train.py"), "--platform", "tpu", str(directory / "cli_export")])
    torch.save(out, directory / "results.pt")


if __name__ == "__main__":
    main()
