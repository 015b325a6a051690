"""The same behaviours under every strategy, each compared with OneDeviceStrategy on the global batch.

Every strategy runs every case once (``conftest.py``); a failing case fails only its own tests.
What a strategy cannot run exactly it refuses in one line, and ``REFUSED`` checks that line
(the refusal table in docs/contract.md lists the same).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import loom
from tests.contract.cases import STEPS, mlp, sgd
from tests.contract.conftest import STRATEGIES
from tests.contract.local_reference import EPOCH_ROUNDS, LOCAL, OUTER, SIMULATED, simulate

PIPELINE_EAGER = "PipelineStrategy runs forward and backward together in its schedule, so the eager loop"

TOLERANCE = 1e-5
# Low precision rounds each replica's matmuls over its own slice of the batch. Measured apart from
# one replica: bf16 1.8e-4 (as far as bf16 is from fp32), fp16 1.0e-5; the forward's dtype shows
# the precision was applied.
LOW_PRECISION_TOLERANCE = {"bf16_mixed": 1e-3, "fp16_mixed": 1e-4}
# What a strategy refuses rather than approximates: (case) -> the start of its one-line error.
REFUSED = {
    "parameter_server": {
        "fp16_mixed": "ValueError: synchronous parameter servers cannot skip an fp16 step that overflowed",
        "clipping": "ValueError: ParameterServerStrategy cannot clip the global gradient norm",
        "batchnorm_cnn": "ValueError: ParameterServerStrategy cannot train BatchNorm layer 'features.1' as one device does",
        "gpt_own_loss": "ValueError: embedding 'transformer.wte' shares its weight with lm_head.weight",
    },
    "tensor_parallel": {
        "fp16_mixed": "ValueError: TensorParallelStrategy cannot skip an fp16 step that overflowed on one process's slice only",
        "batchnorm_cnn": "ValueError: found no layers of BatchNormCNN to split",  # a CNN has no Linear pairs to split
    },
    "hybrid": {
        "fp16_mixed": "ValueError: HybridStrategy cannot skip an fp16 step that overflowed on one process's part of the model only",
        "batchnorm_cnn": "ValueError: found no layers of BatchNormCNN to split",
        "compile_before_prepare": "ValueError: HybridStrategy compiles each block itself",
    },
    # The schedule interleaves forward and backward: the eager loop, and fp16's all-stage skip.
    "pipeline": {
        "eager_loop": f"RuntimeError: {PIPELINE_EAGER}",
        "accumulate_eager": f"RuntimeError: {PIPELINE_EAGER}",
        "fp16_mixed": "ValueError: PipelineStrategy cannot run precision='16-mixed'",
        "batchnorm_cnn": "ValueError: PipelineStrategy cannot train BatchNorm layer 'features.1' as one device does",
        "gpt_own_loss": "ValueError: transformer.wte.weight (stage 0) and lm_head.weight (stage 1) are one tied parameter",
    },
    **{
        name: {  # replica groups (`loom run --groups`): a heal copies one model, optimizer and step count
            "fp16_mixed": f"ValueError: {cls} cannot heal fp16's loss scale",
            "accumulate_eager": "RuntimeError: under --groups each batch that distribute() hands out is one optimizer step",
            "batchnorm_cnn": f"ValueError: {cls} cannot sync BatchNorm statistics across groups",
        }
        for name, cls in (("fault_tolerant", "FaultTolerantMirroredStrategy"), ("fault_tolerant_sharded", "FaultTolerantShardedStrategy"),
                          ("fault_tolerant_diloco", "FaultTolerantDiLoCoStrategy"))  # fmt: skip
    },
    "tpu": {  # one compiled program per step: gradients come from JAX, and XLA devices run bfloat16
        "eager_loop": "RuntimeError: TPUStrategy compiles forward, backward and the update into one XLA program",
        "accumulate_eager": "RuntimeError: TPUStrategy compiles forward, backward and the update into one XLA program",
        "fp16_mixed": "ValueError: TPUStrategy runs mixed precision in bfloat16",
    },
}


# Replica groups combine reduce, gather and fit's training logs within the caller's group: they run
# between steps, where a group may be missing (docs/contract.md's table).
PER_GROUP = ("fault_tolerant", "fault_tolerant_sharded", "fault_tolerant_diloco")


def params(cases: list[str], local: bool = False) -> list[Any]:
    """(strategy, case) pairs for every case a strategy runs (its refusals are tested apart).

    Local SGD and DiLoCo do not equal one device on the global batch: unless ``local``, their
    cases are compared with a simulation of the same instead (``test_local_training_...``).
    """
    return [
        pytest.param(strategy, case, id=f"{strategy}-{case}")
        for strategy in STRATEGIES
        for case in cases
        if case not in REFUSED.get(strategy, {}) and (local or strategy not in LOCAL)
    ]


@pytest.mark.parametrize(
    "strategy, case", [pytest.param(s, c, id=f"{s}-{c}") for s, refused in REFUSED.items() for c in refused]
)
def test_a_refused_feature_is_refused_in_one_line(contract_results, strategy, case):
    for got in contract_results(strategy):
        error = got[case].get("error", "")
        assert error.startswith(REFUSED[strategy][case]) and "\n" not in error, error


def result(contract_results, strategy: str, case: str) -> list[dict[str, Any]]:
    replicas = contract_results(strategy)
    for r, got in enumerate(replicas):
        assert "error" not in got[case], f"{strategy} replica {r}: {got[case]['error']}"
    return [got[case] for got in replicas]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_replicas_agree(replicas: list[dict[str, Any]]) -> None:
    for other in replicas[1:]:
        assert max_difference(replicas[0]["weights"], other["weights"]) == 0.0


@pytest.mark.parametrize("strategy, case", params(["sgd_momentum", "adamw_weight_decay", "clipping", "step_lr"]))
def test_equals_one_device_on_the_global_batch(contract_results, strategy, case):
    replicas = result(contract_results, strategy, case)
    (reference,) = result(contract_results, "one_device", case)
    assert_replicas_agree(replicas)
    assert max_difference(replicas[0]["weights"], reference["weights"]) <= TOLERANCE
    assert replicas[0]["lr"] == pytest.approx(reference["lr"])
    assert replicas[0]["norms"] == pytest.approx(reference["norms"], rel=1e-5)


def test_the_reference_cases_do_what_they_say(contract_results):
    """Equality above is not "nothing moved": each option changes one-device training."""
    (plain,) = result(contract_results, "one_device", "sgd_momentum")
    untrained = {k: v for k, v in mlp().state_dict().items()}
    assert max_difference(plain["weights"], untrained) > 0.05
    (clipped,) = result(contract_results, "one_device", "clipping")
    assert all(n > 0.05 for n in clipped["norms"]) and max_difference(clipped["weights"], plain["weights"]) > 1e-3
    (scheduled,) = result(contract_results, "one_device", "step_lr")
    assert scheduled["lr"] == pytest.approx(0.1 * 0.5**3)  # 3 updates of 2 micro-batches: 3 scheduler steps, not 6


@pytest.mark.parametrize("strategy, case", params(["eager_loop", "accumulate_in_step", "accumulate_eager"]))
def test_train_step_eager_loop_and_accumulation_agree(contract_results, strategy, case):
    """The eager loop and k micro-batches of b all equal ``train_step`` on batches of k*b."""
    replicas = result(contract_results, strategy, case)
    (reference,) = result(contract_results, "one_device", "sgd_momentum")
    assert_replicas_agree(replicas)
    assert max_difference(replicas[0]["weights"], reference["weights"]) <= TOLERANCE


@pytest.mark.parametrize("strategy, case", params(["bf16_mixed", "fp16_mixed"]))
def test_mixed_precision_equals_one_device_in_the_same_precision(contract_results, strategy, case):
    replicas = result(contract_results, strategy, case)
    (reference,) = result(contract_results, "one_device", case)
    (fp32,) = result(contract_results, "one_device", "sgd_momentum" if case == "bf16_mixed" else "adamw_weight_decay")
    assert_replicas_agree(replicas)
    assert replicas[0]["forward_dtypes"] == reference["forward_dtypes"] == [f"torch.{'bfloat16' if case == 'bf16_mixed' else 'float16'}"]
    assert max_difference(replicas[0]["weights"], reference["weights"]) <= LOW_PRECISION_TOLERANCE[case]
    assert max_difference(reference["weights"], fp32["weights"]) > 0  # the precision really changed the math


@pytest.mark.parametrize("strategy, case", [pytest.param(s, c, id=f"{s}-{c}") for s in LOCAL for c in SIMULATED if c not in REFUSED.get(s, {})])
def test_local_training_equals_its_simulation(contract_results, strategy, case):
    """Each replica steps alone on its slice and they meet every 2 steps: 3 steps end apart (replica groups' DiLoCo
    meets at the epoch's end too: they end agreed)."""
    replicas = result(contract_results, strategy, case)
    expected = simulate(strategy, case)
    for got, want in zip(replicas, expected):
        assert max_difference(got["weights"], want) <= LOW_PRECISION_TOLERANCE.get(case, TOLERANCE)
    if strategy in EPOCH_ROUNDS:
        assert_replicas_agree(replicas)
    else:
        assert max_difference(replicas[0]["weights"], replicas[1]["weights"]) > 1e-4  # the last step was local
    if case == "step_lr":
        (reference,) = result(contract_results, "one_device", case)
        assert replicas[0]["lr"] == pytest.approx(reference["lr"])


@pytest.mark.parametrize("strategy, case", [pytest.param(s, c, id=f"{s}-{c}") for s in EPOCH_ROUNDS if s in STRATEGIES
                                            for c in ("gpt_own_loss", "gpt_output_object", "compile_before_prepare", "compile_after_prepare")])
def test_diloco_across_groups_trains_real_model_shapes_and_ends_each_epoch_agreed(contract_results, strategy, case):
    """Tied weights, a model's own loss, an output object: as the simulation of its rounds trains them; compiled, the
    groups' meeting at the epoch's end leaves them bit-identical too."""
    replicas = result(contract_results, strategy, case)
    assert_replicas_agree(replicas)
    if case.startswith("gpt"):
        assert max_difference(replicas[0]["weights"], simulate(strategy, case)[0]) <= TOLERANCE


@pytest.mark.parametrize("strategy", [s for s in OUTER if s not in EPOCH_ROUNDS])  # replica groups': test_fault_tolerant_diloco.py
def test_diloco_resumed_from_a_checkpoint_goes_on_as_the_saved_run_would(contract_results, strategy):
    """The checkpoint carries the outer momentum: a fresh one would take other outer steps after the restore."""
    for got in result(contract_results, strategy, "resume"):
        assert max_difference(got["went_on"], got["resumed"]) == 0.0


@pytest.mark.parametrize("strategy", LOCAL)
def test_local_fit_trains_and_reports_over_every_replica(contract_results, strategy):
    """fit's loss falls, and its metrics (reduced over the replicas) are the same on each. Replica groups log their own
    training; each validates the whole data set on the weights the groups agreed at the epoch's end."""
    first, second = result(contract_results, strategy, "fit_metrics")
    assert first["loss"][-1] < first["loss"][0]
    for key in first:
        if strategy not in PER_GROUP or key.startswith("val_") or key == "predicted":
            assert first[key] == pytest.approx(second[key], rel=1e-6), key


@pytest.mark.parametrize("strategy, case", [p for p in params(["reduce_and_gather"], local=True) if p.values[0] not in PER_GROUP])
def test_reduce_and_gather_cover_every_replica(contract_results, strategy, case):
    for got in result(contract_results, strategy, case):
        n = got["replicas"]
        assert got["sum"] == n * (n + 1) // 2 and got["max"] == n
        assert got["mean"] == pytest.approx((n + 1) / 2)
        assert got["gathered"] == list(range(1, n + 1))


@pytest.mark.parametrize("strategy", [s for s in PER_GROUP if s in STRATEGIES])
def test_replica_groups_reduce_and_gather_within_the_callers_group(contract_results, strategy):
    """Two groups of one process: each reduces and gathers its own value, though both count as replicas."""
    for replica, got in enumerate(result(contract_results, strategy, "reduce_and_gather")):
        mine = replica + 1
        assert got["replicas"] == 2
        assert (got["sum"], got["max"], got["mean"], got["gathered"]) == (mine, mine, mine, [mine])


@pytest.mark.parametrize("strategy, case", [p for p in params(["fit_metrics"]) if p.values[0] not in PER_GROUP])
def test_fit_metrics_are_over_every_replica(contract_results, strategy, case):
    (reference,) = result(contract_results, "one_device", case)
    for got in result(contract_results, strategy, case):
        assert got.keys() == reference.keys()
        for key in reference:
            assert got[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("strategy", [s for s in PER_GROUP if s in STRATEGIES and s not in LOCAL])
def test_replica_groups_fit_validates_and_predicts_every_sample_and_logs_its_own_training(contract_results, strategy):
    """Each group validates and predicts the whole data set (40 samples: a partial last batch) as one
    device does; its training logs are its own half of each batch, whose two means make one device's."""
    (reference,) = result(contract_results, "one_device", "fit_metrics")
    groups = result(contract_results, strategy, "fit_metrics")
    for got in groups:
        assert got.keys() == reference.keys()
        for key in [k for k in reference if k.startswith("val_")] + ["predicted"]:
            assert got[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    for key in ("loss", "accuracy"):
        halves = [pytest.approx(reference[key], rel=1e-5) != got[key] for got in groups]
        assert any(halves), f"{key}: a group logged every replica's samples"
        assert [sum(epoch) / 2 for epoch in zip(*(got[key] for got in groups))] == pytest.approx(reference[key], rel=1e-5), key


@pytest.mark.parametrize("strategy, case", params(["save_and_restore"], local=True))
def test_a_checkpoint_moves_between_strategies(contract_results, reference_checkpoint, tmp_path, strategy, case):
    """Saved under ``strategy``, restored under OneDevice; OneDevice's restored under ``strategy``."""
    root, reference = reference_checkpoint
    replicas = result(contract_results, strategy, case)
    for got in replicas:
        assert max_difference(got["restored"], reference) == 0.0
        assert got["restored_momentum"] and all(m.abs().sum() > 0 for m in got["restored_momentum"].values())
    one = loom.OneDeviceStrategy()
    model, opt = one.prepare(mlp(), sgd)
    one.restore(root / strategy / "saved", model=model, optimizer=opt)
    saved = [got["saved"] for got in replicas]  # local SGD and DiLoCo, apart mid-period, save the replicas' mean
    expected = {k: sum(s[k] / len(saved) for s in saved) for k in saved[0]} if strategy in LOCAL else saved[0]
    assert max_difference({k: v for k, v in model.state_dict().items()}, expected) == 0.0
    assert opt.state_dict()["state"], "the optimizer's state was saved and restored"


@pytest.mark.parametrize("strategy, case", params(["gpt_own_loss", "batchnorm_cnn", "compile_before_prepare", "compile_after_prepare"]))
def test_real_model_shapes_train_as_on_one_device(contract_results, strategy, case):
    """Nested blocks, tied weights, a model's own loss, BatchNorm, compile: each replica starts from
    rank 0's weights though every rank seeded its own way, and ends where one device does."""
    replicas = result(contract_results, strategy, case)
    (reference,) = result(contract_results, "one_device", case)
    assert_replicas_agree(replicas)
    assert max_difference(replicas[0]["weights"], reference["weights"]) <= TOLERANCE


@pytest.mark.parametrize("strategy, case", params(["gpt_output_object"]))
def test_an_output_object_keeps_its_class_under_mixed_precision(contract_results, strategy, case):
    replicas = result(contract_results, strategy, case)
    (reference,) = result(contract_results, "one_device", case)
    assert [r["output_class"] for r in replicas] == ["Output"] * len(replicas)
    want = reference["weights"]
    if strategy == "parameter_server":  # the embedding tables live on the servers, not in the worker's module
        want = {k: v for k, v in want.items() if k in replicas[0]["weights"]}
    assert max_difference(replicas[0]["weights"], want) <= LOW_PRECISION_TOLERANCE["bf16_mixed"]


@pytest.mark.parametrize("strategy, case", params(["fit_then_save", "compile_before_prepare", "compile_after_prepare"], local=True))
def test_the_users_own_module_saves_with_the_models_keys(contract_results, strategy, case):
    """``save(model=<the module passed to fit or compile>)`` writes the model's own keys: OneDevice restores it strictly."""
    (got, *_) = result(contract_results, strategy, case)
    one = loom.OneDeviceStrategy()
    model, _ = one.prepare(mlp(), sgd)
    restored = one.restore(got["path"], model=model)
    assert restored is not None and restored["step"] == STEPS
    if strategy not in LOCAL:  # local SGD's replicas end apart; the checkpoint holds one of them
        (reference,) = result(contract_results, "one_device", case)
        reference_model, _ = one.prepare(mlp(), sgd)
        one.restore(reference["path"], model=reference_model)
        assert max_difference(model.state_dict(), reference_model.state_dict()) <= TOLERANCE

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restore_of_an_empty_or_missing_directory_changes_nothing(contract_results, strategy):
    """The start-of-run ``strategy.restore(dir)`` of docs/checkpoints.md: None, the optimizer, scheduler
    and data position untouched, and the training that follows is the one without the call."""
    replicas = result(contract_results, strategy, "restore_of_nothing")
    if strategy in LOCAL:
        expected = simulate(strategy, "adamw_weight_decay")
    else:
        (reference,) = result(contract_results, "one_device", "adamw_weight_decay")
        expected = [reference["weights"]] * len(replicas)
    for got, want in zip(replicas, expected):
        assert got["returned"] == [True, True] and got["unchanged"] == [True, True, True]
        assert max_difference(got["weights"], want) <= TOLERANCE
