"""Fixtures that fail a test which leaks distributed state into the test process."""

import os

import pytest
import torch.distributed as dist

LEAKABLE_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "LOOM_TIMEOUT")


@pytest.fixture(autouse=True)
def own_process_registry(tmp_path_factory, monkeypatch):
    """Each test's loom processes count only each other when they divide the cores (loom.devices),
    not the jobs of tests running beside it."""
    monkeypatch.setenv("LOOM_PROCESS_REGISTRY", str(tmp_path_factory.mktemp("registry")))


@pytest.fixture(autouse=True)
def no_leaked_distributed_state():
    before = {k: os.environ.get(k) for k in LEAKABLE_ENV}
    yield
    assert not dist.is_initialized(), "the test left a process group initialised"
    after = {k: os.environ.get(k) for k in LEAKABLE_ENV}
    assert after == before, f"the test changed the environment: {before} -> {after}"
