"""Each private name in loom.compat still exists and behaves as loom relies on: a torch upgrade
that changes one fails here, by name."""

import importlib
import inspect
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from loom import compat
from loom.checkpoint.safe_reader import quiet
from loom.launch.torchrun import LaunchOptions, torchrun_argv
from tests.helpers import ROOT, job_env


def test_every_class_of_the_dcp_index_allow_list_exists():
    for module, names in compat.DCP_INDEX_CLASSES.items():
        for name in names:
            assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone from torch"


def test_a_dcp_index_written_by_this_torch_uses_only_allowed_classes(tmp_path):
    with quiet():
        dcp.save({"w": torch.ones(3, 2), "nested": {"b": torch.zeros(4, dtype=torch.int64)}}, checkpoint_id=tmp_path, no_dist=True)
    path = compat.dcp_index_path(FileSystemReader(tmp_path))
    assert path == tmp_path / ".metadata" and path.is_file()
    used = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            used.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as f:
        Recording(f).load()
    torch_values = {(m, n) for m, n in used if m == "torch" and not isinstance(getattr(torch, n), type)}  # dtypes, layouts
    refused = {(m, n) for m, n in used - torch_values if n not in compat.DCP_INDEX_CLASSES.get(m, ())}
    assert not refused, f"DCP's index now pickles {sorted(refused)}: add them to loom.compat.DCP_INDEX_CLASSES if safe"


def test_the_default_store_is_the_one_the_group_was_made_with():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = store.num_keys()
        compat.default_store().set("loom-compat", "seen")
        assert store.num_keys() == before + 1 and compat.default_store().get("loom-compat") == b"seen"
    finally:
        dist.destroy_process_group()


def test_exit_handlers_run_once_when_asked():
    code = "import atexit, loom.compat as c; atexit.register(print, 'handler'); c.run_exit_handlers(); print('after')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["handler", "after"]


def test_torchrun_parses_loom_s_command_line_and_runs_it_in_process():
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(torchrun_argv(LaunchOptions(nproc=2), ["train.py", "--lr", "0.1"]))
    assert (args.nproc_per_node, args.standalone, args.module, args.training_script) == ("2", True, True, "loom.launch.worker")
    assert args.training_script_args == ["train.py", "--lr", "0.1"]
    assert list(inspect.signature(torchrun.run).parameters) == ["args"]


def test_dcp_does_not_step_an_optimizer_whose_parameters_have_gradients():
    """``compat.optimizer_state_dict`` relies on it to keep DCP from stepping a fresh optimizer."""
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.weight.grad = torch.zeros_like(model.weight)
    assert get_optimizer_state_dict(model, opt)["state"] == {} and not opt.state

    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    model.weight.grad = None
    assert compat.optimizer_state_dict(model, fresh)["state"] == {}
    assert not fresh.state and model.weight.grad is None and model.bias.grad is None


def test_torch_compile_returns_the_module_type_unwrap_peels():
    net = nn.Linear(2, 2)
    compiled = torch.compile(net, backend="eager")
    assert isinstance(compiled, compat.compiled_module_type()) and compiled._orig_mod is net


def test_compile_like_compiles_another_module_in_place_with_the_same_backend():
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled, other, x = torch.compile(Scaled(), backend=backend), Scaled(), torch.randn(3, 2)
    compat.compile_like(compiled, other)
    assert torch.equal(other(x), 2 * x) and len(graphs) == 1
    assert list(other.state_dict()) == ["scale"]  # in place: the names stay the module's


class Scaled(nn.Module):
    """A module of this file: torch.compile starts no frame in torch's own modules (nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def test_importing_loom_leaves_torch_compile_unloaded():
    """torch._dynamo costs every process 1.3 s of CPU to import; loom only looks for it."""
    code = "import sys, loom, loom.launch.worker; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=60)
    assert done.stdout.split() == ["False"], done.stderr


def test_the_elastic_agent_is_built_by_name_and_has_the_hooks_loom_extends():
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    assert all(callable(getattr(LocalElasticAgent, hook, None)) for hook in compat.AGENT_HOOKS)
    with compat.elastic_agent(dict):
        assert launcher_api.LocalElasticAgent is dict
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_storage_use_count_counts_tensors_views_and_numpy_arrays_holding_the_memory():
    storage = torch.UntypedStorage(64)
    assert compat.storage_use_count(storage) == 1
    tensor = torch.empty(0).set_(storage, 0, (16,))
    view, array = tensor[2:5], tensor.numpy()
    del tensor
    assert compat.storage_use_count(storage) > 1
    del view
    assert compat.storage_use_count(storage) > 1  # the NumPy array alone
    del array
    assert compat.storage_use_count(storage) == 1


def test_worker_failure_pickles_and_reraises_with_the_worker_s_traceback():
    try:
        raise KeyError("row 7")
    except KeyError:
        failure = pickle.loads(pickle.dumps(compat.worker_failure("in a test worker")))
    with pytest.raises(KeyError, match="row 7") as raised:
        failure.reraise()
    assert "in a test worker" in str(raised.value)


def test_torchrun_options_are_read_from_its_own_parser():
    assert compat.torchrun_accepts("--shutdown-timeout")  # torch 2.13's torchrun has it
    assert not compat.torchrun_accepts("--no-such-option")


def test_ddp_buffer_sync_option_is_the_one_this_torch_takes():
    import inspect

    assert compat.DDP_BUFFER_SYNC in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters


def test_ddp_backward_sync_flag_and_bucket_layout_are_the_ones_ddp_reads():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        compat.lay_out_ddp_buckets(ddp)
        compat.set_ddp_backward_sync(ddp, False)
        assert not compat.ddp_backward_syncs(ddp)
        with ddp.no_sync():  # torch's own switch sets the same flag
            assert not compat.ddp_backward_syncs(ddp)
        compat.set_ddp_backward_sync(ddp, True)
        with ddp.no_sync():
            assert not compat.ddp_backward_syncs(ddp)
        assert compat.ddp_backward_syncs(ddp)
    finally:
        dist.destroy_process_group()


def test_non_persistent_buffers_are_the_ones_left_out_of_the_state_dict():
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert compat.non_persistent_buffers(module) == {"scratch"} and list(module.state_dict()) == ["kept"]


def test_swap_class_keeps_the_module_and_refuses_an_unrelated_class():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    layer, x = nn.Linear(2, 2), torch.ones(1, 2)
    layer.register_forward_hook(lambda m, i, o: None)
    keys = list(layer.state_dict())
    compat.swap_class(layer, Doubled)
    assert type(layer) is Doubled and torch.allclose(layer(x), 2 * nn.functional.linear(x, layer.weight, layer.bias))
    compat.swap_class(layer, nn.Linear)
    assert type(layer) is nn.Linear and list(layer.state_dict()) == keys and layer._forward_hooks
    with pytest.raises(TypeError, match="swap_class gives a module a subclass of its class or takes one back, not Linear -> ReLU"):
        compat.swap_class(layer, nn.ReLU)


def test_pooling_options_dynamo_limit_and_functorch_stack_read_as_loom_expects():
    assert compat.pair(3) == (3, 3) and compat.pair((2, 1)) == (2, 1)
    assert isinstance(compat.dynamo_recompile_limit(), int) and compat.dynamo_recompile_limit() > 0
    seen = []
    torch.func.vmap(lambda t: seen.append(compat.inside_functorch_transform()) or t)(torch.ones(2))
    assert seen == [True] and not compat.inside_functorch_transform()


def test_torchax_has_the_convolution_lowering_loom_overrides():
    code = "import loom.compat as c, inspect; print(list(inspect.signature(c.torchax_convolution()).parameters)[:2])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["['input',", "'weight']"], done.stderr + done.stdout


def test_a_step_marked_unwrapped_is_left_alone_by_optimizer_init_and_its_update_runs_the_hooks():
    class Wrapped(torch.optim.Optimizer):
        @compat.leave_step_unwrapped
        def step(self, closure=None):
            return self._update() if self.defaults["acts"] else None

        @torch.optim.Optimizer.profile_hook_step
        def _update(self):
            seen.append("update")

    step, seen = Wrapped.step, []
    opt = Wrapped([nn.Parameter(torch.ones(1))], {"acts": False})
    opt.register_step_pre_hook(lambda *_: seen.append("pre"))
    opt.register_step_post_hook(lambda *_: seen.append("post"))
    opt.step()
    opt.defaults["acts"] = True
    opt.step()
    assert Wrapped.step is step and seen == ["pre", "update", "post"]


def test_compiled_original_and_child_names_read_the_modules_loom_expects():
    net = nn.Sequential(nn.Linear(2, 2))
    shared = nn.ReLU()
    net.add_module("a", shared)
    net.add_module("b", shared)
    net.add_module("gone", None)
    assert compat.compiled_original(torch.compile(net, backend="eager")) is net
    assert compat.child_names(net) == ["0", "a", "b", "gone"]  # named_children gives ["0", "a"]


def test_torchft_manager_says_healing_quorum_id_and_members_where_loom_reads_them():
    """A real quorum of one group, ``group_3`` of 1 process: the private attributes hold what loom expects."""
    pytest.importorskip("torchft", reason="the ft extra: pip install loom[ft]")
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda _: None, state_dict=dict, min_replica_size=1,
        use_async_quorum=True, timeout=timeout, rank=0, world_size=1, replica_id="group_3",
        lighthouse_addr=lighthouse.address(), store_addr="localhost", store_port=store.port,
    )  # fmt: skip
    try:
        assert compat.ft_quorum_ranks(manager) is None, "torchft's ProcessGroupGloo._global_ranks is not None before a quorum"
        manager.start_quorum()
        manager.wait_quorum()
        assert compat.ft_healing(manager) is False, "torchft's Manager._healing is not False in a quorum without a heal"
        quorum_id = compat.ft_quorum_id(manager)
        assert isinstance(quorum_id, int) and quorum_id > 0, f"torchft's Manager._quorum_id is {quorum_id!r}, not the quorum's id"
        assert compat.ft_quorum_ranks(manager) == [3], "torchft's ProcessGroupGloo._global_ranks is not [group * N + rank]"
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
