"""TensorParallelStrategy: two processes holding half of each split layer train as one device.

Tolerance: a row-wise layer (attention's and the MLP's output projections, the embedding)
adds the two processes' partial sums after their matmuls, in another order than one matmul
adds them; that reassociation is about 1e-7 relative in fp32, and 10 AdamW steps of the tiny
GPT keep it within 1e-5 (measured 4e-7).
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import loom
from examples.gpt_model import GPT
from loom.strategies.model_parallel import mesh
from loom.strategies.model_parallel.tensor_parallel import default_plan, resolve_plan
from tests.helpers import run_ranks
from tests.scripts import tp_gpt

pytestmark = pytest.mark.xdist_group("tensor_parallel")  # one launched job for the module's tests

TOLERANCE = 1e-5
USER_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise", "head": "output"}


def _job(directory: str) -> dict:
    """Every run in the same two processes: the default plan; a user's plan (MLPs and head only) with each
    process seeded differently, as nanoGPT seeds them; a tied embedding and head; compiled before and after."""
    tp = lambda plan=None: loom.TensorParallelStrategy(plan=plan, timeout=60)  # noqa: E731
    return {
        "default": tp_gpt.train(tp),
        "user": tp_gpt.train(lambda: tp(USER_PLAN), seed_by_rank=True),
        "tied": tp_gpt.train(tp, f"{directory}/tied", build=tp_gpt.TiedGPT),
        "compiled_before": tp_gpt.train(tp, f"{directory}/compiled", compile="before"),
        "compiled_after": tp_gpt.train(tp, compile="after"),
        "refused": _refusals(),
        "broadcast": _broadcast(),
    }


def _broadcast() -> dict[str, torch.Tensor]:
    """broadcast_states over buckets of 5 elements, with a bool buffer (gloo has no bool), from per-rank values."""
    rank = torch.distributed.get_rank()
    module = nn.Linear(3, 2)  # 6 + 2 float elements: two buckets
    with torch.no_grad():
        module.weight.fill_(rank + 1.0)
        module.bias.fill_(-rank - 1.0)
    module.register_buffer("mask", torch.tensor([rank == 0, rank == 1]))
    with patch.object(mesh, "BROADCAST_BUCKET", 5):
        mesh.broadcast_states(module, torch.device("cpu"))
    return {k: v.clone() for k, v in module.state_dict().items()}


def _refusals() -> dict[str, str]:
    """A plan that would untie a tied weight: the embedding split, its tied output layer whole."""
    refused = {}
    try:
        loom.TensorParallelStrategy(plan={"embed": "embedding"}, timeout=60).prepare(tp_gpt.TiedGPT())
    except ValueError as error:
        refused["untie"] = str(error)
    return refused


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict, str]:
    directory = str(tmp_path_factory.mktemp("tensor_parallel"))
    ranks = run_ranks(_job, 2, directory, timeout=240)
    return ranks, tp_gpt.train(loom.OneDeviceStrategy), directory


@pytest.fixture(scope="session")
def tied_reference() -> dict:
    return tp_gpt.train(loom.OneDeviceStrategy, build=tp_gpt.TiedGPT)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["default", "user", "compiled_before", "compiled_after"])
def test_ten_adamw_steps_equal_one_device_on_the_global_batch(runs, plan):
    ranks, reference, _ = runs
    first, second = (r[plan] for r in ranks)
    assert first["replicas"] == 1, "both processes are one replica: they read the same batch"
    assert max_difference(first["weights"], second["weights"]) == 0.0
    assert max_difference(first["weights"], reference["weights"]) <= TOLERANCE
    torch.manual_seed(0)
    assert max_difference(reference["weights"], GPT(tp_gpt.CONFIG).state_dict()) > 1e-3, "training moved the weights"
    assert first["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.timeout(300)
def test_per_rank_seeds_start_every_process_from_rank_0s_model(runs):
    """The user's plan leaves attention and the norms whole: they are rank 0's on both processes, so the
    two processes of the replica compute one loss, and training equals OneDevice's from rank 0's seed."""
    ranks, reference, _ = runs
    first, second = (r["user"] for r in ranks)
    assert first["losses"] == second["losses"]
    assert max_difference(first["weights"], reference["weights"]) <= TOLERANCE


@pytest.mark.timeout(300)
def test_a_tied_embedding_and_head_stay_tied_and_train_as_on_one_device(runs, tied_reference):
    ranks, _, directory = runs
    assert tied_reference["tied"]
    for rank in ranks:
        tied = rank["tied"]
        assert tied["tied"], "the output layer and the embedding share one split weight"
        assert tied["local_shapes"]["embed.weight"] == (tp_gpt.CONFIG.vocab // 2, tp_gpt.CONFIG.width)
        assert max_difference(tied["weights"], tied_reference["weights"]) <= TOLERANCE
    one = loom.OneDeviceStrategy()  # the checkpoint restores the model that was trained
    model, opt = one.prepare(tp_gpt.TiedGPT(), tp_gpt.adamw)
    one.restore(f"{directory}/tied", model=model, optimizer=opt)
    assert model.head.weight is model.embed.weight
    assert max_difference(model.state_dict(), ranks[0]["tied"]["weights"]) == 0.0


@pytest.mark.timeout(300)
def test_a_plan_that_would_untie_a_tied_weight_is_refused_in_one_line(runs):
    for rank in runs[0]:
        assert rank["refused"]["untie"] == (
            "the tensor-parallel plan splits the tied weights embed.weight (split on dim 0) and head.weight (whole) unlike, "
            "which would untie them: split both sides alike (an embedding as 'embedding' with its output layer as 'output') "
            "or leave both out of the plan"
        )


@pytest.mark.timeout(300)
def test_compiled_before_or_after_prepare_the_plan_is_the_same_and_keys_show_no_compilation(runs):
    ranks, _, directory = runs
    for rank in ranks:
        assert rank["compiled_before"]["local_shapes"] == rank["default"]["local_shapes"]
        assert rank["compiled_before"]["compiled_graphs"] > 0
    one = loom.OneDeviceStrategy()  # strict: a key with _orig_mod in it would be refused
    model = one.prepare(GPT(tp_gpt.CONFIG))
    one.restore(f"{directory}/compiled", model=model)
    assert max_difference(model.state_dict(), ranks[0]["compiled_before"]["weights"]) == 0.0


@pytest.mark.timeout(300)
def test_every_process_gets_rank_0s_parameters_and_buffers_bucket_by_bucket(runs):
    for rank in runs[0]:
        got = rank["broadcast"]
        assert torch.equal(got["weight"], torch.ones(2, 3)) and torch.equal(got["bias"], -torch.ones(2))
        assert got["mask"].tolist() == [True, False]


@pytest.mark.timeout(300)
def test_the_layers_are_really_split(runs):
    ranks, _, _ = runs
    default, user = ranks[0]["default"]["local_shapes"], ranks[0]["user"]["local_shapes"]
    width, vocab = tp_gpt.CONFIG.width, tp_gpt.CONFIG.vocab
    assert default["blocks.0.attn.q.weight"] == (width // 2, width)  # column-wise: half the output features
    assert default["blocks.0.attn.proj.weight"] == (width, width // 2)  # row-wise: half the input features
    assert default["blocks.1.mlp.fc.weight"] == (2 * width, width)
    assert default["embed.weight"] == (vocab // 2, width) and default["head.weight"] == (vocab // 2, width)
    assert "blocks.0.ln1.weight" not in default, "layers the plan does not name stay whole"
    assert "blocks.0.attn.q.weight" not in user and user["blocks.0.mlp.proj.weight"] == (width, 2 * width)


@pytest.mark.timeout(300)
def test_the_clipped_global_norm_equals_one_device(runs):
    ranks, reference, _ = runs
    assert all(n > tp_gpt.MAX_NORM for n in reference["norms"]), "every step clips"
    for rank in ranks:
        assert rank["default"]["norms"] == pytest.approx(reference["norms"], rel=1e-5)


def test_the_default_plan_pairs_the_common_layouts():
    plan = default_plan(GPT(tp_gpt.CONFIG), 2)
    block = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"}
    expected = {f"blocks.{i}.{name}": style for i in range(2) for name, style in block.items()}
    assert plan == {**expected, "embed": "embedding", "pos": "embedding", "head": "output"}
    assert default_plan(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)), 2) == {"0": "colwise", "2": "rowwise"}
    # 3 hidden units do not split in two: that pair stays whole, and the model has nothing else
    with pytest.raises(ValueError, match=r"^found no layers of Sequential to split over 2 processes .* pass plan=") as error:
        default_plan(nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 2)), 2)
    assert "\n" not in str(error.value)


def test_a_plan_naming_a_missing_module_is_one_line():
    with pytest.raises(ValueError) as error:
        resolve_plan(GPT(tp_gpt.CONFIG), {"blocks.0.mlp.fc": "colwise", "blocks.0.ffn.proj": "rowwise"})
    message = str(error.value)
    assert message.startswith("the tensor-parallel plan names 'blocks.0.ffn.proj', which is not a module of GPT; name its layers")
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"^the tensor-parallel plan names 'layers\.\*\.fc'"):
        resolve_plan(GPT(tp_gpt.CONFIG), {"layers.*.fc": "colwise"})
    with pytest.raises(ValueError, match=r"^unknown tensor-parallel style 'columnwise' for 'head'; choose one of: colwise, rowwise, output, embedding$"):
        resolve_plan(GPT(tp_gpt.CONFIG), {"head": "columnwise"})


class NormedMLP(nn.Module):
    """An MLP that normalises its hidden units: the norm needs all of them, and sits between fc and proj."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16, elementwise_affine=False)  # no weights: only its normalized_shape says 16
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.fc(x)))


def test_a_norm_between_the_two_sides_of_a_pair_is_refused_in_one_line():
    """Each process would hold 8 of the 16 hidden features, and the norm would fail deep in torch."""
    batchnorm = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16, affine=False), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ValueError) as error:
        resolve_plan(batchnorm, {"0": "colwise", "3": "rowwise"})
    assert str(error.value) == (
        "the tensor-parallel plan splits 0 column-wise and 3 row-wise, but 1 (BatchNorm1d) between them needs all 16 "
        "features and each process holds a slice: leave that pair out of the plan (pass plan= without 0 and 3) or move 1 "
        "outside the pair"
    )
    model = nn.Sequential(NormedMLP(), NormedMLP())  # torch's style objects and patterns too
    with pytest.raises(ValueError, match=r"^the tensor-parallel plan splits 0\.fc column-wise and 0\.proj row-wise, but 0\.norm \(LayerNorm\) between"):
        resolve_plan(model, {"*.fc": ColwiseParallel(), "*.proj": RowwiseParallel()})
    # the default plan leaves such pairs whole; norms outside a pair (GPT's) are no obstacle
    with pytest.raises(ValueError, match=r"^found no layers of Sequential to split"):
        default_plan(batchnorm, 2)
    assert "0.fc" not in default_plan(nn.Sequential(NormedMLP(), nn.Linear(8, 32), nn.Linear(32, 8)), 2)
    resolve_plan(GPT(tp_gpt.CONFIG), default_plan(GPT(tp_gpt.CONFIG), 2))
    resolve_plan(model, {"0.fc": "colwise", "1.proj": "rowwise"})  # no pair in one parent: nothing between


def test_a_split_side_without_its_partner_is_refused_in_one_line():
    """The next layer would get a slice of the features and fail deep in torch with a shape error."""
    mlp = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    with pytest.raises(ValueError) as error:
        resolve_plan(mlp, {"0": "colwise"})
    assert str(error.value) == (
        "the tensor-parallel plan splits 0 column-wise, but no row-wise layer after it takes its split output, so the "
        "next layer would get a slice of its features: add the row-wise side of the pair, or make 0 'output' to gather "
        "its output whole"
    )
    with pytest.raises(ValueError, match=r"^the tensor-parallel plan splits 2 row-wise, but no column-wise layer before it gives it a split input: add"):
        resolve_plan(mlp, {"2": "rowwise"})
    resolve_plan(mlp, {"0": "output"})  # gathered whole
    resolve_plan(mlp, {"0": ColwiseParallel(use_local_output=False)})  # a DTensor that knows its layout, as loss_parallel takes


def test_the_default_plan_splits_a_tied_pair_alike_or_leaves_it_whole():
    plan = default_plan(tp_gpt.TiedGPT(), 2)
    assert plan["embed"] == "embedding" and plan["head"] == "output"  # both split by vocabulary rows: one weight
    capped = tp_gpt.TiedGPT()
    capped.embed.max_norm = 1.0  # an embedding that renormalises its rows stays whole, so its tied head does too
    plan = default_plan(capped, 2)
    assert "embed" not in plan and "head" not in plan and plan["blocks.0.mlp.fc"] == "colwise"
