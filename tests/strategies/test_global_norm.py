"""One global norm and one "parameters that are not the model's" check, shared by the strategies."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from loom.strategies.model_parallel.dtensor_norm import clip_grad_norm, global_norm
from loom.strategies.optimizer import check_owned
from tests.helpers import ROOT, job_env


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_plain_gradients_norm_and_clip_as_torch_s_clip_grad_norm(norm_type):
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    ours(torch.randn(5, 4)).pow(2).sum().backward()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        b.grad = a.grad.clone()
    total = clip_grad_norm(list(ours.parameters()), 0.1, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.1, norm_type)
    assert torch.allclose(total, expected)
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert torch.equal(global_norm([]), torch.zeros(()))


def test_the_global_norm_leaves_dtensor_unloaded():
    """The pipeline clips with it in processes that never load DTensor (a second of CPU to import)."""
    code = (
        "import sys, torch; from loom.strategies.model_parallel.dtensor_norm import global_norm; "
        "global_norm([torch.ones(3)]); print('torch.distributed.tensor' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=60)
    assert done.stdout.split() == ["False"], done.stderr


def test_an_optimizer_on_other_tensors_is_refused_naming_the_fix():
    model = nn.Linear(2, 2)
    check_owned(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters())
    with pytest.raises(ValueError, match=r"the optimizer holds parameters that are not the model's; .*pass a factory"):
        check_owned(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), model.parameters())
