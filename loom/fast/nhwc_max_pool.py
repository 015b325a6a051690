"""Max-pooling of a contiguous (NCHW) CPU batch by eager's channels_last kernel (the fast path's exact ``pool_nhwc``).

ATen pools a contiguous CPU input one output element at a time, and its channels_last kernel a
vector of channels at a time: on W2's first pool (256x32x32x32 fp32, two threads, forward) 24 ms
against 3.5 ms, a quarter of the step at loom's defaults. Copying the input to channels_last,
pooling it there and copying the output and indices back makes W2's two pools 1.4-1.9x faster,
forward and backward, and its step 1.15-1.17x (``bench/pool_nhwc.py``).

It changes no number. Both kernels scan each window in the same order from the same start with
the same comparison (``val > max || isnan(val)``), so the output and the indices are eager's bit
for bit (the sign of a zero included; NaN payloads aside: eager's bf16 kernel passes a NaN
through fp32), and the gradient is eager's own backward on those indices. With fewer channels
than ``MIN_CHANNELS`` (a vector of fp32) the channels_last kernel has nothing to run in
parallel, and on a small batch (``MIN_ELEMENTS``) the copies cost more than they save: eager's
runs. ``bench/pool_nhwc.py`` measures both bounds (its "forced" rows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.compat import inside_functorch_transform, swap_class

MIN_CHANNELS = 16  # one AVX-512 vector of fp32: below it the channels_last kernel loses
MIN_ELEMENTS = 1 << 16  # below it the copies cost more than the kernel saves (8x16x8x8: half eager's speed)


class _NhwcPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, options: tuple) -> torch.Tensor:
        out, indices = (_contiguous(t) for t in _pooled(x, options))
        ctx.save_for_backward(x, indices)  # what eager's autograd saves: the input and its indices
        ctx.save_for_forward(indices)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, indices = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *ctx.options, indices), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, _: None) -> torch.Tensor:
        """Forward-mode AD, as eager's formula: the tangent of each window's chosen element."""
        (indices,) = ctx.saved_tensors
        return tangent.flatten(-2).gather(-1, indices.flatten(-2)).view_as(indices)


def _pooled(x: torch.Tensor, options: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and indices of the channels_last kernel, channels_last."""
    return torch.ops.aten.max_pool2d_with_indices(x.contiguous(memory_format=torch.channels_last), *options)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with eager's strides. A channels_last result with 1x1 sides already counts as contiguous
    but keeps channels_last strides, which a convolution after it would take for that layout."""
    t = t.contiguous()
    n, c, h, w = t.shape
    return t if t.stride() == (c * h * w, h * w, w, 1) else torch.empty(t.shape, dtype=t.dtype).copy_(t)


def takes(x: Any) -> bool:
    """Whether eager's contiguous kernel would pool this batch and the channels_last one can do it
    faster: a 4-D contiguous (strided) CPU batch of enough channels, outside tracing,
    ``torch.compile`` and ``torch.func`` transforms (which take eager's pool)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.device.type != "cpu" or x.layout != torch.strided or not x.is_floating_point():
        return False
    if x.shape[1] < MIN_CHANNELS or x.numel() < MIN_ELEMENTS or not x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return False
    return not (torch.jit.is_tracing() or torch.compiler.is_compiling() or inside_functorch_transform())


class NhwcMaxPool2d(nn.MaxPool2d):
    """An ``nn.MaxPool2d`` that pools a contiguous CPU batch through the channels_last kernel; any
    other input, or a module set to return its indices, runs eager's. ``torch.jit.script``
    compiles eager's pool in its place, and leaves the module as it is."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # nn.MaxPool2d's forward
            return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation, ceil_mode=self.ceil_mode, return_indices=self.return_indices)
        return self._pool(input)

    @torch.jit.unused
    def _pool(self, input: torch.Tensor) -> torch.Tensor:
        if self.return_indices or not takes(input):
            return super().forward(input)
        options = (self.kernel_size, self.stride if self.stride is not None else [], self.padding, self.dilation, self.ceil_mode)
        if not (input.requires_grad and torch.is_grad_enabled()):  # no indices to keep
            return _contiguous(_pooled(input, options)[0])
        return _NhwcPool.apply(input, options)


def use(module: nn.Module) -> int:
    """Give the model's plain ``nn.MaxPool2d`` layers the class above; how many there were."""
    layers = [m for m in module.modules() if type(m) is nn.MaxPool2d]
    for layer in layers:
        swap_class(layer, NhwcMaxPool2d)
    return len(layers)
