"""HybridStrategy on four processes: each mesh trains the tiny GPT as one device does on the global batch.

Tolerance 1e-5, as for TensorParallelStrategy: FSDP's reduce-scatter, the tensor-parallel
row-wise all-reduce and the pipeline's micro-batches each add partial sums in another order
than one device's matmul (about 1e-7 relative in fp32; measured 3.6e-7 after 10 AdamW steps).
The tenth batch is short (tp_gpt.LAST_BATCH): the pipeline runs it stage after stage, unscheduled.
"""

from __future__ import annotations

import pytest
import torch

import loom
from examples.gpt_model import GPT, next_byte_loss
from tests.helpers import run_ranks
from tests.scripts import tp_gpt

pytestmark = pytest.mark.xdist_group("hybrid")  # one launched job of four processes for the module's tests

TOLERANCE = 1e-5
MESHES = {
    "pp_x_fsdp": {"dp_shard": 2, "pp": 2},  # what DeepSpeed's pipeline engine cannot combine with ZeRO-3; compiled
    "fsdp_x_tp": {"dp_shard": 2, "tp": 2},  # with activation checkpointing
}
# torch.compile's default backend, inductor, generates and builds C++ on CPU: 33 CPU-s for two processes
# of this GPT with a cold cache, more than the suite can spend. aot_eager runs the same tracing and
# ahead-of-time autograd through the stages and FSDP, without generating code.
COMPILE = "aot_eager"
TIED_MESH = {"dp": 2, "tp": 2}  # replicas that FSDP replicates, each splitting a tied embedding and head


def _job(directory: str) -> dict:
    """Every run seeds each process differently, as nanoGPT does: all must start from rank 0's model."""
    results = {}
    for name, mesh in MESHES.items():
        make = lambda mesh=mesh, name=name: loom.HybridStrategy(  # noqa: E731
            mesh=mesh, activation_checkpointing=name == "fsdp_x_tp", compile=COMPILE if name == "pp_x_fsdp" else False, timeout=60)
        results[name] = tp_gpt.train(make, save_to=f"{directory}/{name}" if name == "pp_x_fsdp" else None, seed_by_rank=True)
    results["tied"] = tp_gpt.train(lambda: loom.HybridStrategy(mesh=TIED_MESH, timeout=60), build=tp_gpt.TiedGPT, seed_by_rank=True)
    results["lengths"] = _changing_lengths(loom.HybridStrategy(mesh=TIED_MESH, compile=COMPILE, timeout=60))
    results["hsdp_initial"] = _hsdp_initial()
    results["refused"] = _refusals()
    return results


def _changing_lengths(strategy: loom.Strategy) -> list[float]:
    """The losses of three steps on batches of three sequence lengths (every replica the same batch)."""
    torch.manual_seed(0)
    model, opt = strategy.prepare(GPT(tp_gpt.CONFIG), tp_gpt.adamw)
    step = strategy.train_step(model, next_byte_loss, opt)
    batches = [torch.randint(0, 256, (4, length), generator=torch.Generator().manual_seed(length)) for length in (8, 12, 16)]
    return [float(step(x, x)) for x in batches]


def _hsdp_initial() -> dict[str, torch.Tensor]:
    """HSDP's model right after prepare, each rank seeded differently: replicas and shards alike are rank 0's."""
    strategy = loom.HybridStrategy(mesh={"dp": 2, "dp_shard": 2}, timeout=60)
    torch.manual_seed(strategy.cluster.rank)
    model = strategy.prepare(GPT(tp_gpt.CONFIG))
    return {k: tp_gpt.whole(v) for k, v in loom.unwrap(model).state_dict().items()}


def _refusals() -> dict[str, str]:
    """With a pp axis: the eager loop, and an optimizer built before the stage is sharded."""
    strategy, refused = loom.HybridStrategy(mesh=MESHES["pp_x_fsdp"], timeout=60), {}
    gpt = GPT(tp_gpt.CONFIG)
    for name, attempt in {
        "backward": lambda: strategy.backward(torch.zeros((), requires_grad=True)),
        "optimizer": lambda: strategy.prepare(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1)),
        "fast_path": lambda: strategy.prepare(gpt, fast_path=True, example_input=torch.zeros(2, 8, dtype=torch.long)),
        "compile": lambda: loom.HybridStrategy(mesh=MESHES["pp_x_fsdp"], compile="inductr"),
        "compiled_model": lambda: loom.HybridStrategy(mesh=MESHES["fsdp_x_tp"], timeout=60).prepare(torch.compile(GPT(tp_gpt.CONFIG))),
        "compiled_after": lambda: _compiled_after_prepare()(torch.zeros(2, tp_gpt.CONFIG.context, dtype=torch.long)),
    }.items():
        try:
            attempt()
        except (RuntimeError, TypeError, ValueError) as error:
            refused[name] = f"{type(error).__name__}: {error}"
    return refused


def _compiled_after_prepare() -> torch.nn.Module:
    """``torch.compile(prepare(gpt))`` over FSDP and tensor parallel at once: refused at its first call."""
    return torch.compile(loom.HybridStrategy(mesh=MESHES["fsdp_x_tp"], timeout=60).prepare(GPT(tp_gpt.CONFIG)), backend=COMPILE)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict, str]:
    directory = str(tmp_path_factory.mktemp("hybrid"))
    return run_ranks(_job, 4, directory, timeout=240), tp_gpt.train(loom.OneDeviceStrategy), directory


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_ten_adamw_steps_equal_one_device_on_the_global_batch(runs, mesh):
    ranks, reference, _ = runs
    got = [rank[mesh] for rank in ranks]
    assert got[0]["replicas"] == 2
    weights = tp_gpt.merged(got)
    assert weights.keys() == reference["weights"].keys()
    assert max((weights[k] - reference["weights"][k]).abs().max().item() for k in weights) <= TOLERANCE
    torch.manual_seed(0)
    untrained = GPT(tp_gpt.CONFIG).state_dict()
    assert max((weights[k] - untrained[k]).abs().max().item() for k in weights) > 1e-3, "training moved the weights"
    for rank in got:  # every process clipped with the whole model's norm, all stages and shards together
        assert rank["norms"] == pytest.approx(reference["norms"], rel=1e-5)


@pytest.mark.timeout(300)
def test_a_tied_embedding_and_head_stay_tied_over_tp_and_train_as_on_one_device(runs):
    ranks, _, _ = runs
    reference = tp_gpt.train(loom.OneDeviceStrategy, build=tp_gpt.TiedGPT)
    for rank in ranks:
        tied = rank["tied"]
        assert tied["tied"] and tied["replicas"] == 2
        assert tied["local_shapes"]["embed.weight"] == (tp_gpt.CONFIG.vocab // 2, tp_gpt.CONFIG.width)
        assert max((tied["weights"][k] - v).abs().max().item() for k, v in reference["weights"].items()) <= TOLERANCE


@pytest.mark.timeout(300)
def test_compiled_tensor_parallel_blocks_take_a_new_sequence_length(runs):
    """A symbolic length fails torch's tracer on split layers: compile= traces each length instead."""
    reference = _changing_lengths(loom.OneDeviceStrategy())
    for rank in runs[0]:
        assert rank["lengths"] == pytest.approx(reference, rel=1e-5)


@pytest.mark.timeout(300)
def test_hsdp_replicas_and_shards_start_from_rank_0s_model(runs):
    torch.manual_seed(0)
    initial = GPT(tp_gpt.CONFIG).state_dict()
    for rank in runs[0]:
        assert max((rank["hsdp_initial"][k] - v).abs().max().item() for k, v in initial.items()) == 0.0


@pytest.mark.timeout(300)
def test_compiled_blocks_train_as_the_uncompiled_ones(runs):
    """The pipeline of shards above ran compiled and equals one device; here: it really was compiled."""
    for rank in runs[0]:
        assert rank["pp_x_fsdp"]["compiled_graphs"] > 0, "torch.compile traced the stage's blocks"
        assert rank["fsdp_x_tp"]["compiled_graphs"] == rank["pp_x_fsdp"]["compiled_graphs"], "compile=False compiles nothing"


@pytest.mark.timeout(300)
def test_each_parallelism_really_splits_the_model(runs):
    ranks, _, _ = runs
    width = tp_gpt.CONFIG.width
    first, last = ranks[0], ranks[-1]
    assert "head.weight" not in first["pp_x_fsdp"]["weights"] and "embed.weight" not in last["pp_x_fsdp"]["weights"]  # stages
    assert first["pp_x_fsdp"]["local_shapes"]["blocks.0.mlp.fc.weight"] == (2 * width, width)  # FSDP: half of 4w rows
    assert first["fsdp_x_tp"]["local_shapes"]["blocks.0.mlp.fc.weight"] == (width, width)  # tp then FSDP: a quarter


@pytest.mark.timeout(300)
def test_activation_checkpointing_recomputes_the_blocks(runs):
    ranks, reference, _ = runs
    assert reference["mlp_calls"] == tp_gpt.STEPS
    assert ranks[0]["fsdp_x_tp"]["mlp_calls"] == 2 * tp_gpt.STEPS  # forward, and again in backward
    assert ranks[0]["pp_x_fsdp"]["mlp_calls"] == 0, "the last block is on the last stage only"


@pytest.mark.timeout(300)
def test_a_pipeline_of_shards_checkpoint_restores_on_one_device(runs):
    ranks, _, directory = runs
    one = loom.OneDeviceStrategy()
    model, opt = one.prepare(GPT(tp_gpt.CONFIG), tp_gpt.adamw)
    one.restore(f"{directory}/pp_x_fsdp", model=model, optimizer=opt)
    saved = tp_gpt.merged([rank["pp_x_fsdp"] for rank in ranks])
    assert max((model.state_dict()[k] - saved[k]).abs().max().item() for k in saved) == 0.0
    assert len(opt.state_dict()["state"]) == len(list(model.parameters())), "every stage's Adam state was saved"


@pytest.mark.timeout(300)
def test_the_eager_loop_and_an_optimizer_object_with_a_pp_axis_and_a_compiled_model_are_refused_in_one_line(runs):
    """A model compiled after prepare is refused only where torch's tracer fails (tensor parallel under FSDP);
    the contract's {"dp": 1, "tp": 2} runs it and equals one device."""
    for rank in runs[0]:
        refused = rank["refused"]
        assert refused["backward"].startswith("RuntimeError: HybridStrategy with a pp axis runs forward and backward together in its schedule")
        assert refused["optimizer"].startswith("TypeError: HybridStrategy with a pp axis builds the optimizer on this stage's parameters")
        assert refused["fast_path"].startswith("ValueError: HybridStrategy does not take prepare(fast_path=...): each process holds only part")
        assert refused["compile"].startswith("ValueError: unknown torch.compile backend 'inductr'; choose one of: ")
        assert "inductor" in refused["compile"]
        assert refused["compiled_model"].startswith(
            "ValueError: HybridStrategy compiles each block itself (torch cannot trace the whole model around FSDP's hooks): "
            "pass it the uncompiled model and compile=True")
        assert refused["compiled_after"].startswith(
            "ValueError: HybridStrategy cannot run torch.compile(model) over tensor-parallel weights that FSDP shards "
            "(torch's tracer fails on them): call the prepared model uncompiled, and pass HybridStrategy(compile=True)")
        assert all("\n" not in line for line in refused.values())
