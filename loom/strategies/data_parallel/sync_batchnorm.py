"""Batch statistics over the global batch: ``MirroredStrategy(sync_batchnorm=True)``.

On CUDA this is torch's ``SyncBatchNorm``. torch's refuses CPU tensors, so on CPU (gloo) the
layers become ``GlooSyncBatchNorm``: the same state-dict keys, with its mean and variance
all-reduced through ``torch.distributed.nn``'s differentiable all-reduce. Its backward sums
every replica's gradient of the statistics, which DDP's averaging then turns into the
gradient of the global batch's mean loss: N replicas equal one replica on the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from loom.compat import BatchNormBase


class GlooSyncBatchNorm(BatchNormBase):
    """SyncBatchNorm for CPU tensors; two all-reduces per layer (mean, then variance) for accuracy.

    Not a subclass of torch's ``SyncBatchNorm``, which DDP refuses on CPU.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        self._check_input_dim(input)
        x = input.float()  # statistics in fp32, as torch's BatchNorm keeps them under autocast
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        sums = dist_fn.all_reduce(torch.cat([x.sum(dims), local]))
        count = sums[-1]
        mean = sums[:-1] / count
        centered = x - mean.reshape(shape)
        var = dist_fn.all_reduce(centered.pow(2).sum(dims)) / count
        if self.track_running_stats:
            self._track(mean.detach(), var.detach(), count.detach())
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _track(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        """Running statistics as ``_BatchNorm`` keeps them: unbiased variance, momentum or cumulative."""
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        unbiased = var * count / (count - 1).clamp(min=1)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer of ``module`` replaced by one that computes global-batch statistics."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, BatchNormBase) and not isinstance(module, GlooSyncBatchNorm):
        device = next((t.device for t in [*module.parameters(), *module.buffers()]), None)  # meta under ShardedStrategy.scope()
        synced = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, device=device)
        synced.load_state_dict(module.state_dict(), assign=True)
        synced.train(module.training)
        if module.affine:  # keep the very Parameter objects: an optimizer may already hold them
            synced.weight, synced.bias = module.weight, module.bias
        return synced
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, device)
        if converted is not child:
            setattr(module, name, converted)
    return module


def refuse_torch_sync_batchnorm(module: nn.Module, device: torch.device, strategy: str) -> None:
    """torch's ``SyncBatchNorm`` (``nn.SyncBatchNorm.convert_sync_batchnorm(model)``) runs on GPUs only: on CPU,
    name the option that syncs the statistics there instead of DDP's error."""
    name = next((n for n, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
    if device.type == "cpu" and name is not None:
        raise ValueError(
            f"{strategy} cannot run torch's SyncBatchNorm on CPU (layer '{name}'; torch's runs on GPUs only): keep the "
            f"model's BatchNorm layers (no convert_sync_batchnorm) and pass {strategy}(sync_batchnorm=True), which syncs them over gloo"
        )


def first_batchnorm(model: nn.Module) -> str | None:
    """The name of ``model``'s first BatchNorm layer, for the strategies that refuse one; None without."""
    return next((name for name, module in model.named_modules() if isinstance(module, BatchNormBase)), None)
