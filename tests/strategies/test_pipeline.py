"""PipelineStrategy: the split (in this process), then one launched two-process job for the rest."""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections import namedtuple
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import loom
from examples.gpt_model import GPT, GPTConfig
from loom.strategies.model_parallel.pipeline.strategy import PipelineModule, PipelineStep
from loom.strategies.model_parallel.pipeline.runner import PipelineRunner, ScheduledStage, _header, stage_owners
from loom.strategies.model_parallel.pipeline.split import LastStage, build_stage, check_untied, describe, find_layers, owned_tensors, split_bounds, time_costs
from loom.strategies.precision import Precision
from tests.scripts.pipeline_job import NanoGPT
from tests.helpers import SCRIPTS, loom_run
from tests.scripts import pipeline_job

pytestmark = pytest.mark.xdist_group("pipeline")  # the job's tests share one launch


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(context=8, width=16, heads=2, layers=4))


def sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def run_stages(model: nn.Module, bounds: list[int], x: torch.Tensor) -> torch.Tensor:
    """The stages one after another in this process, as the pipeline runs them across processes."""
    layers = find_layers(model)
    out = x
    for s in range(len(bounds) - 1):
        stage = build_stage(layers, bounds, s)
        if isinstance(stage, LastStage):
            stage.example = x
        out = stage(out)
    return out


@pytest.mark.parametrize("make, x", [(gpt, torch.randint(0, 256, (3, 8))), (sequential, torch.randn(5, 6))], ids=["gpt", "sequential"])
def test_a_split_into_n_stages_gives_the_unsplit_outputs(make, x):
    model = make()
    layers = find_layers(model)
    expected = model(x)
    for stages in range(1, len(layers.names) + 1):
        bounds = split_bounds(layers, stages)
        assert len(bounds) == stages + 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
        assert torch.equal(run_stages(model, bounds, x), expected), bounds
    bounds = split_bounds(layers, 2, [layers.names[-1]])
    assert bounds == [0, len(layers.names) - 1, len(layers.names)]
    assert torch.equal(run_stages(model, bounds, x), expected)


def test_blocks_nested_in_containers_are_found_by_their_dotted_path():
    """nanoGPT keeps its blocks in transformer.h, a ModuleList inside a ModuleDict: the split reaches them
    (automatically, or at a named block), the modules around them at each level go to the first and last
    stages, and the stages give the unsplit outputs, ``(logits, None)`` included."""
    model, x = NanoGPT(), torch.randint(0, 256, (3, 8))
    for layers in (find_layers(model), find_layers(model, ["transformer.h.3"])):
        assert layers.names == [f"transformer.h.{i}" for i in range(4)]
        assert layers.before == ["transformer.wte", "transformer.wpe"] and layers.after == ["transformer.ln_f", "lm_head"]
        logits, none = run_stages(model, split_bounds(layers, 2, ["transformer.h.3"]), x)
        assert torch.equal(logits, model(x)[0]) and none is None
    body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    wrapped = nn.ModuleDict({"body": body, "head": nn.Linear(4, 2)})  # a Sequential inside a container
    assert find_layers(wrapped).names == ["body.0", "body.1", "body.2"] and find_layers(wrapped).after == ["head"]
    with pytest.raises(ValueError, match=r"^split point 'transformer.wte' is no block of an nn.ModuleList or nn.Sequential of NanoGPT"):
        find_layers(model, ["transformer.wte"])


def test_the_stages_hold_the_models_parameters_once():
    """Every parameter in exactly one stage, shared with the model (the optimizer updates the model)."""
    model = gpt()
    layers = find_layers(model)
    bounds = split_bounds(layers, 3)
    held = [id(p) for s in range(3) for p in build_stage(layers, bounds, s).parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters())


def test_stages_are_balanced_by_parameters_or_by_time():
    layers = find_layers(gpt())
    assert split_bounds(layers, 2) == [0, 2, 4]  # embeddings on the first stage, the head on the last
    assert describe(layers, [0, 2, 4]) == (
        "pipeline split: stage 0: embed, pos, blocks.0-1 (10,784 params); stage 1: blocks.2-3, ln_f, head (10,688 params)"
    )
    torch.manual_seed(0)
    slow = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4), nn.Linear(4, 4), Sleep(0.05))
    timed = find_layers(slow)
    costs = time_costs(timed, torch.randn(2, 4))
    assert costs[3] >= 0.05 and costs[3] > sum(costs[:3])
    assert split_bounds(timed, 2) == [0, 1, 4]  # 320 parameters, then 280
    assert split_bounds(timed, 2, costs=costs) == [0, 3, 4]  # the slow layer alone


class Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def test_zbv_stages_go_down_and_back_up_the_processes():
    assert stage_owners("1f1b", 4, 1) == [0, 1, 2, 3]
    assert stage_owners("interleaved_1f1b", 2, 2) == [0, 1, 0, 1]
    assert stage_owners("zbv_zero_bubble", 2, 2) == [0, 1, 1, 0]


@pytest.mark.parametrize(
    "build, line",
    [
        (lambda: split_bounds(find_layers(sequential()), 6), "PipelineStrategy cannot cut Sequential into 6 stages: it has 5 layers (0, 1, 2, 3, 4); use at most 5 stages"),
        (lambda: split_bounds(find_layers(gpt()), 2, ["blocks.9"]), "split point 'blocks.9' names no layer of GPT; stages start at one of: blocks.1, blocks.2, blocks.3"),
        (lambda: split_bounds(find_layers(gpt()), 3, ["blocks.2"]), "PipelineStrategy(stages=3) needs 2 split point(s)"),
        (lambda: find_layers(nn.Linear(2, 2)), "PipelineStrategy splits an nn.Sequential, or a model whose forward runs an nn.ModuleList of blocks; Linear has neither"),
        (lambda: loom.PipelineStrategy(schedule="1f2b"), "unknown pipeline schedule '1f2b'; choose one of: gpipe, 1f1b, interleaved_1f1b"),
        (lambda: loom.PipelineStrategy(schedule="interleaved_1f1b"), "schedule 'interleaved_1f1b' interleaves several stages per process: pass virtual_stages=2"),
        (lambda: loom.PipelineStrategy(schedule="zbv_zero_bubble", virtual_stages=3), "schedule 'zbv_zero_bubble' runs 2 stage(s) per process"),
        (lambda: loom.PipelineStrategy(balance="time"), "balance='time' times each layer on an example batch: pass example_inputs="),
        (lambda: loom.PipelineStrategy(precision="16-mixed"), "PipelineStrategy cannot run precision='16-mixed'"),
        (lambda: loom.PipelineStrategy(), "PipelineStrategy runs one stage per process: start the script with `loom run --nproc N"),
    ],
    ids=["more-stages-than-layers", "unknown-split-point", "split-point-count", "no-layers", "schedule", "interleaved", "zbv", "time", "fp16", "not-launched"],
)
def test_bad_input_gets_one_line(build, line):
    with pytest.raises(Exception) as error:
        build()
    assert str(error.value).startswith(line) and "\n" not in str(error.value), str(error.value)


# ---- one launched job of two processes ------------------------------------------------------
@pytest.fixture(scope="session")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipeline")
    strategy = loom.OneDeviceStrategy()
    model, opt, _, _ = pipeline_job.train(strategy, 2)
    strategy.save(root / "one", step=2, model=model, optimizer=opt)
    done = loom_run(["run", "--nproc", "2", "--timeout", "60", str(SCRIPTS / "pipeline_job.py"), "--dir", str(root)], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(root / f"results-{r}.pt", weights_only=True) for r in range(2)]
    return {"root": root, "ranks": ranks, "stdout": done.stdout, "one_device": {k: v.clone() for k, v in model.state_dict().items()}}


def whole(ranks: list[dict[str, Any]], *keys: str) -> dict[str, torch.Tensor]:
    """The stages' tensors together: each process holds its own stage's."""
    parts = [_at(r, keys) for r in ranks]
    assert not set(parts[0]) & set(parts[1]), "each tensor lives on one stage"
    return parts[0] | parts[1]


def _at(tree: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_ten_adamw_steps_of_the_gpt_equal_one_device(job):
    """Up to float reassociation: the pipeline sums 4 micro-batches' mean losses / 4 where one device
    takes one mean, and the clipping norm adds the stages' squared norms; Adam keeps that within 2e-6."""
    weights, reference = whole(job["ranks"], "gpt", "weights"), whole(job["ranks"], "gpt", "reference")
    assert weights.keys() == job["one_device"].keys()
    assert max_difference(weights, reference) <= 1e-5
    assert max_difference(reference, pipeline_job.model().state_dict()) > 1e-3  # the steps moved the weights
    for rank in job["ranks"]:  # every process gets the loss and the outputs, from the last stage
        assert rank["gpt"]["losses"] == pytest.approx(rank["gpt"]["reference_losses"], abs=1e-5)
        assert rank["gpt"]["outputs"] == torch.Size([pipeline_job.BATCH, 8, 256])
        assert rank["gpt"]["eval_difference"] < 1e-5
        pipelined, one_device = rank["gpt"]["evaluate"]  # loom.evaluate runs the stages too
        assert pipelined == pytest.approx(one_device, abs=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"])
def test_every_schedules_loss_equals_the_unpipelined_loss(job, schedule):
    for rank in job["ranks"]:
        got = rank["schedules"][schedule]
        assert got["loss_difference"] <= 1e-6 and got["weight_difference"] <= 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_an_epochs_short_last_batch_runs_stage_after_stage_and_equals_one_device(job, schedule):
    """19 samples in batches of 8: torch's schedules keep the first batch's shapes, so the last 3 go
    through the stages unpipelined, as one micro-batch (ZBV: two of them on one process)."""
    for rank in job["ranks"]:
        got = rank["uneven"][schedule]
        assert got["rows"] == [8, 8, 3]
        assert got["losses"] == pytest.approx(rank["uneven"]["reference_losses"], abs=1e-5)
    weights, reference = whole(job["ranks"], "uneven", schedule, "weights"), whole(job["ranks"], "uneven", schedule, "reference")
    assert max_difference(weights, reference) <= 1e-5


@pytest.mark.parametrize(
    "case, line",
    [
        ("shape", "ValueError: PipelineStrategy: this batch's micro-batches are inputs [2, 4], targets [2, 4] but the pipeline was built for inputs [2, 8]"),
        ("microbatches", "ValueError: PipelineStrategy(microbatches=4) with accumulate=1 cannot split a batch of 6 into 4 equal micro-batches"),
        ("eager", "RuntimeError: PipelineStrategy runs forward and backward together in its schedule"),
        ("fast_path", "ValueError: PipelineStrategy does not take prepare(fast_path=...): each process holds only part of the model"),
        ("batchnorm", "ValueError: PipelineStrategy cannot train BatchNorm layer '1' as one device does: each micro-batch would be normalised"),
    ],
)
def test_a_bad_batch_gets_one_line_on_every_process(job, case, line):
    for rank in job["ranks"]:
        error = rank["errors"][case]
        assert error.startswith(line) and "\n" not in error, error


def test_the_split_is_printed_once_by_the_chief(job):
    lines = [line for line in job["stdout"].splitlines() if line.startswith("pipeline split:")]
    assert lines[0] == "pipeline split: stage 0: embed, pos, blocks.0-1 (10,784 params); stage 1: blocks.2-3, ln_f, head (10,688 params)"
    assert len(lines) == 28  # twenty-eight prepares in the job, each printed by one process


def test_a_checkpoint_moves_between_the_pipeline_and_one_device(job):
    ranks = job["ranks"]
    trained = whole(ranks, "gpt", "weights")
    one = loom.OneDeviceStrategy()  # the stages' checkpoint, restored whole on one device
    model, opt = one.prepare(pipeline_job.model(), pipeline_job.adamw)
    one.restore(job["root"] / "pipeline", model=model, optimizer=opt)
    assert max_difference(dict(model.state_dict()), trained) == 0.0
    assert opt.param_groups[0]["lr"] == 1e-3 and len(opt.state_dict()["state"]) == len(list(model.parameters()))
    assert max_difference(whole(ranks, "restore", "own"), trained) == 0.0  # and into a pipeline again
    for rank in ranks:
        restored, saved = rank["restore"]["own_state"], rank["restore"]["saved_state"]
        assert restored and max_difference(restored, saved) == 0.0 and rank["restore"]["lr"] == 1e-3
        assert rank["restore"]["one_device_steps"] == [2]  # OneDevice's checkpoint, read by the stages
    assert max_difference(whole(ranks, "restore", "one_device"), job["one_device"]) == 0.0


def test_a_parameter_tied_across_stages_is_refused():
    model = gpt()
    model.head.weight = model.embed.weight  # the common tie of input and output embeddings
    layers = find_layers(model)
    with pytest.raises(ValueError, match=r"^embed.weight \(stage 0\) and head.weight \(stage 1\) are one tied parameter"):
        check_untied(layers, split_bounds(layers, 2))
    check_untied(layers, split_bounds(layers, 1))  # one stage holds both


def test_each_process_holds_and_optimizes_only_its_stage(job):
    """A built optimizer loses the other stages' parameters, which the model holds as meta tensors."""
    total = len(list(pipeline_job.model().parameters()))
    counts = [rank["built_optimizer"] for rank in job["ranks"]]
    assert all(c["in_optimizer"] for c in counts)
    assert counts[0]["held"] + counts[1]["held"] == total and all(c["held"] + c["meta"] == total for c in counts)
    assert all(c["held"] > 0 and c["meta"] > 0 for c in counts)


def test_balance_by_time_is_measured_once_and_used_by_every_process(job):
    bounds = [rank["time_balance"] for rank in job["ranks"]]
    assert bounds[0] == bounds[1] and bounds[0][0] == 0 and bounds[0][-1] == 4 and len(bounds[0]) == 3


def test_replicated_pipelines_average_gradients_over_the_dp_axis(job):
    """What a hybrid's {"dp": 2, "pp": ...} runs: each replica reads half the global batch, and two
    replicas' averaged gradients equal one device's on the whole batch."""
    got = [rank["replicated"] for rank in job["ranks"]]
    assert [g["replica"] for g in got] == [0, 1] and all(g["replicas"] == 2 and g["reduced"] == 3 for g in got)
    assert all(g["rows"] == pipeline_job.BATCH // 2 and g["difference"] <= 1e-5 for g in got)


# ---- the seams of real models, from the same job --------------------------------------------
def test_nested_blocks_and_outputs_with_none_train_as_one_device(job):
    """nanoGPT's layout split automatically and at "transformer.h.3": two AdamW steps equal one device's,
    and each stage holds the model's own state-dict keys."""
    for name in ("auto", "dotted"):
        weights = whole(job["ranks"], "seams", "nano", name, "weights")
        reference = job["ranks"][0]["seams"]["nano"][name]["reference"]
        assert weights.keys() == reference.keys() and max_difference(weights, reference) <= 1e-5
        for rank in job["ranks"]:
            assert rank["seams"]["nano"][name]["losses"] == pytest.approx(rank["seams"]["nano"]["reference_losses"], abs=1e-5)
    assert job["ranks"][0]["seams"]["nano"]["dotted"]["bounds"] == [0, 3, 4]


def test_shape_inference_changes_no_buffer(job):
    """torch infers the shapes sent between stages by a real forward at the first step; a buffer counting
    training forwards (as BatchNorm's num_batches_tracked) sees only the 2 steps' 2 micro-batches each."""
    assert [rank["seams"]["counted"] for rank in job["ranks"]] == [None, 4]  # the counter lives on stage 1


@pytest.mark.parametrize("case", ["pipeline_before", "pipeline_after", "hybrid_before", "hybrid_after"])
def test_torch_compile_composes_with_the_pipeline_in_both_orders(job, case):
    """``prepare(torch.compile(model))`` and ``torch.compile(prepare(model))`` train as one device does, the
    stages' blocks compiled by the user's backend (Hybrid: mesh {"pp": 2}); the checkpoint of what the user
    holds has the model's own keys."""
    assert max_difference(whole(job["ranks"], "seams", "compiled", case, "weights"), job["one_device"]) <= 1e-5
    for rank in job["ranks"]:
        assert rank["seams"]["compiled"][case]["graphs"] > 0
        assert rank["seams"]["compiled"][case]["outputs"] == torch.Size([3, 8, 256])  # inference through it too
    one = loom.OneDeviceStrategy()  # strict: a key with _orig_mod in it would not match
    restored, _ = one.prepare(pipeline_job.model(), pipeline_job.adamw)
    one.restore(job["root"] / f"compiled_{case}", model=restored)
    assert max_difference(dict(restored.state_dict()), job["one_device"]) <= 1e-5


@pytest.mark.parametrize("strategy", ["pipeline", "hybrid"])
def test_save_and_restore_take_the_module_the_user_passed_after_fit(job, strategy):
    """Its other stages' tensors are meta: each stage saves and restores its own (Hybrid: mesh {"pp": 2})."""
    fitted = whole(job["ranks"], "seams", "after_fit", strategy, "fitted")
    assert max_difference(fitted, job["one_device"]) <= 1e-5
    assert max_difference(whole(job["ranks"], "seams", "after_fit", strategy, "restored"), fitted) == 0.0
    one = loom.OneDeviceStrategy()
    restored, _ = one.prepare(pipeline_job.model(), pipeline_job.adamw)
    one.restore(job["root"] / ("after_fit" if strategy == "pipeline" else "hybrid_after_fit"), model=restored)
    assert max_difference(dict(restored.state_dict()), fitted) == 0.0


def test_restore_of_an_empty_directory_takes_no_step_under_a_hybrid_pp_axis(job):
    """DCP creates missing optimizer state by a step at lr 0; with nothing to load it must not run (Adam's
    step count would start at 1). PipelineStrategy's own case is a row of the contract suite."""
    for rank in job["ranks"]:
        assert rank["seams"]["from_nothing"]["returned"] is None and rank["seams"]["from_nothing"]["adam_steps"] == [2]
    assert max_difference(whole(job["ranks"], "seams", "from_nothing", "weights"), job["one_device"]) <= 1e-5


def test_a_models_output_class_its_own_tensors_and_its_own_loss_train_as_one_device(job):
    """``OwnLossGPT`` returns a ``ModelOutput`` (a dict with attributes), and its ``transformer`` holds a
    parameter and a buffer of its own: every stage together holds the model's state-dict keys, and two AdamW
    steps equal one device's, with a loss_fn reading ``out.logits``, or with the model's own loss
    (``train_step(model, None, opt)``: the targets reach the first and last stages, one micro-batch at a time)."""
    reference = job["ranks"][0]["seams"]["own_loss"]["reference"]
    for name in ("loss_fn", "1f1b", "zbv"):
        weights = whole(job["ranks"], "seams", "own_loss", name, "weights")
        assert weights.keys() == reference.keys() and max_difference(weights, reference) <= 1e-5, name
        for rank in job["ranks"]:
            got, one = rank["seams"]["own_loss"][name], rank["seams"]["own_loss"]
            assert got["losses"] == pytest.approx(one["reference_losses"], abs=1e-5)
            assert got["evaluate"] == pytest.approx(one["reference_evaluate"], abs=1e-5)
            assert got["step_outputs"] == ("ModelOutput", torch.Size([pipeline_job.BATCH, 8, 256]))
            assert got["inferred"] == ("ModelOutput", torch.Size([3, 8, 256]))


@dataclasses.dataclass
class Logits:
    logits: torch.Tensor


Pair = namedtuple("Pair", ["logits"])
OUTPUTS = {"model_output": pipeline_job.ModelOutput, "dataclass": Logits, "namedtuple": Pair}


class Classed(NanoGPT):
    """nanoGPT's layout, its logits in an output of class ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, idx: torch.Tensor) -> Any:
        return OUTPUTS[self.kind](logits=super().forward(idx)[0])


@pytest.mark.parametrize("kind", ["model_output", "dataclass", "namedtuple"])
def test_the_stages_hand_back_the_models_output_class(kind):
    """As torch's schedule runs the last stage (tensors out, rebuilt), as inference and an unpipelined batch
    run the stages, and as the output is broadcast to the other stages' processes (its header, pickled)."""
    model, x, y = Classed(kind), torch.randint(0, 256, (4, 8)), torch.randint(0, 256, (4, 8))
    expected = model(x)
    layers = find_layers(model)
    bounds = split_bounds(layers, 2)
    first, last = build_stage(layers, bounds, 0), ScheduledStage(build_stage(layers, bounds, 1), torch.device("cpu"))
    last.module.example = x
    for _ in range(2):  # torch's shape inference, then a micro-batch
        out = last.rebuild(last(first(x)))
        assert type(out) is type(expected) and torch.equal(out.logits, expected.logits)
    header = pickle.loads(pickle.dumps(_header(expected)))
    assert type(header) is type(expected) and header.logits.shape == (4, 8, 256)
    runner = PipelineRunner(layers, bounds, "interleaved_1f1b", 2, 2, torch.device("cpu"), Precision("32", torch.device("cpu")))  # both stages here
    assert type(runner.forward(x)) is type(expected)
    _, outputs = runner.step_whole(x, y, pipeline_job.logits_loss, 1.0)
    assert type(outputs) is type(expected) and torch.equal(outputs.logits, expected.logits)


def test_an_unpipelined_batch_and_inference_take_the_models_own_loss():
    """A batch smaller than the schedule's runs stage after stage: with ``loss_fn=None`` its first and last
    stages get the targets, and its loss and gradients are the model's own."""
    model, x, y = pipeline_job.OwnLossGPT(), torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
    model(x, y).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    layers = find_layers(model)
    runner = PipelineRunner(layers, split_bounds(layers, 2), "interleaved_1f1b", 2, 2, torch.device("cpu"), Precision("32", torch.device("cpu")))
    loss, outputs = runner.step_whole(x, y, None, 1.0)
    assert loss == model(x, y).loss.detach() and torch.equal(outputs.loss, loss)
    assert max(float((p.grad - expected[n]).abs().max()) for n, p in model.named_parameters()) <= 1e-6
    assert runner.forward(x, y).loss == loss  # inference, as loom.evaluate(model, None, ...) calls it


def test_tensors_held_by_a_container_on_the_path_to_the_blocks_stay_with_the_first_stage():
    """``transformer`` holds a parameter and a buffer of its own: the first stage keeps them (and trains the
    parameter), under the model's own keys; no tensor of the model is left to no stage."""
    model = pipeline_job.OwnLossGPT()
    layers = find_layers(model)
    bounds = split_bounds(layers, 2)
    stages = [owned_tensors(layers, bounds, [s]) for s in range(2)]
    assert {"transformer.scale", "transformer.shift"} <= stages[0].keys()
    assert sorted([*stages[0], *stages[1]]) == sorted(model.state_dict())
    assert any(p is model.transformer.scale for p in build_stage(layers, bounds, 0).parameters())
    assert describe(layers, bounds).startswith("pipeline split: stage 0: transformer.wte, transformer.wpe, transformer.h.0-1 (10,800 params)")
    blocks = nn.ModuleList([nn.Linear(2, 2)])
    blocks.register_parameter("gate", nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError) as error:
        find_layers(nn.ModuleDict({"blocks": blocks}))
    assert str(error.value) == (
        "PipelineStrategy cannot split blocks: it holds blocks.gate itself, outside its blocks, where no stage runs it; "
        "register it on the module that holds the blocks, or on a block"
    )


def test_a_sequential_or_a_dict_of_inputs_cannot_compute_its_own_loss_and_gets_one_line():
    one = loom.OneDeviceStrategy()
    model = sequential()
    layers = find_layers(model)
    prepared = PipelineModule(model, one, PipelineRunner(layers, [0, 5], "1f1b", 1, 1, torch.device("cpu"), Precision("32", torch.device("cpu"))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as error:
        PipelineStep(one, prepared, None, opt)
    assert str(error.value) == (
        "OneDeviceStrategy runs an nn.Sequential layer by layer, never a forward(inputs, targets) that computes a loss: "
        "pass train_step a loss_fn(outputs, targets)"
    )
    gpt_model = pipeline_job.OwnLossGPT()
    gpt_layers = find_layers(gpt_model)
    gpt_prepared = PipelineModule(gpt_model, one, PipelineRunner(gpt_layers, [0, 4], "1f1b", 1, 1, torch.device("cpu"), Precision("32", torch.device("cpu"))))
    with pytest.raises(ValueError, match=r"^OneDeviceStrategy passes a model that computes its own loss its inputs and targets as model\(inputs, targets\)"):
        PipelineStep(one, gpt_prepared, None, torch.optim.SGD(gpt_model.parameters(), lr=0.1))({"idx": torch.zeros(2, 8, dtype=torch.long)}, None)


def test_hybrid_hands_tensor_parallelism_the_uncompiled_model(monkeypatch):
    """``prepare(torch.compile(model))`` with pp and tp: the plan names the model's layers, not ``_orig_mod.``'s."""
    hybrid = object.__new__(loom.HybridStrategy)
    given = []
    monkeypatch.setattr("loom.strategies.model_parallel.hybrid.broadcast_states", lambda model, device: None)
    hybrid._announce = lambda: None
    hybrid._fast_path_for_parts = lambda fast_path: None  # the exact defaults print on the chief, which this stub has not
    hybrid._device = torch.device("cpu")
    hybrid._pipeline = SimpleNamespace(prepare=lambda model: SimpleNamespace(runner=SimpleNamespace(modules={})))
    hybrid._parallelize = lambda model, units: given.append(model)
    hybrid._guard = nullcontext
    model = sequential()
    hybrid.prepare(torch.compile(model))
    assert given == [model]
