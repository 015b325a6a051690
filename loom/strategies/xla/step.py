"""The training step as one XLA program: forward, loss, gradients, their reduction, the update.

The user's torch module and loss run through torchax, which turns torch operations into JAX
ones while ``jax.jit`` traces them; ``jax.value_and_grad`` gives the gradients, and the
optimizer's update (``optim.py``) follows in the same program. The batch is split over the
mesh's ``data`` axis and the parameters are replicated (or split over ``model``), so XLA's
partitioner puts the cross-device all-reduce of the gradients into the program itself.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import TYPE_CHECKING, Any

import torch

from loom.strategies.optimizer import inner_optimizer
from loom.strategies.outputs import call_with_targets, map_outputs, model_loss
from loom.strategies.step import LossFn, TrainStep, batch_len
from loom.strategies.xla.export import export_requested, export_step
from loom.strategies.xla.optim import GroupRule, group_hypers, group_rules, update
from loom.strategies.xla.runtime import environment
from loom.strategies.xla.state import DeviceState, to_torch

if TYPE_CHECKING:
    from loom.strategies.xla.strategy import TPUStrategy


class XLATrainStep(TrainStep):
    """``loss = step(inputs, targets)``, one compiled program per call; same options as ``TrainStep``."""

    def __init__(self, strategy: TPUStrategy, model: torch.nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, max_grad_norm: float | None = None, accumulate: int = 1) -> None:  # fmt: skip
        super().__init__(strategy, model, loss_fn, optimizer, scheduler, max_grad_norm, accumulate)
        self.state: DeviceState = strategy.device_state(model, inner_optimizer(optimizer))
        self._programs: dict[tuple[Any, ...], Any] = {}
        self._device_outputs: Any = None  # the output's tensors, as a list of device arrays
        self.skeleton: Any = None  # the model's output with a _Slot for each tensor, recorded when traced
        self._device_norm: Any = None

    # outputs and the norm stay on the devices until they are read
    @property  # type: ignore[override]
    def outputs(self) -> Any:
        arrays = self._device_outputs
        if arrays is None:
            return None
        return map_outputs(lambda v: to_torch(arrays[v.index]) if isinstance(v, _Slot) else v, self.skeleton)

    @outputs.setter
    def outputs(self, value: Any) -> None:
        self._device_outputs = value

    @property  # type: ignore[override]
    def grad_norm(self) -> torch.Tensor | None:
        return None if self._device_norm is None else to_torch(self._device_norm)

    @grad_norm.setter
    def grad_norm(self, value: Any) -> None:
        self._device_norm = value

    def program(self, inputs: Any, targets: Any) -> tuple[Any, tuple[Any, ...]]:
        """The jitted step for these arguments, and the arguments themselves (device arrays)."""
        strategy: TPUStrategy = self.strategy  # type: ignore[assignment]
        state = self.state
        state.upload()
        rules = group_rules(state.optimizer)
        size = batch_len(inputs if targets is None else targets) * strategy.num_hosts // strategy.data_parallel_size
        micro = min(self.accumulate, size)
        key = (rules, micro)
        if key not in self._programs:
            self._programs[key] = self._compile(rules, micro)
        x, y = strategy.to_device(inputs), strategy.to_device(targets)
        args = (state.params, state.frozen, state.buffers, state.slots, state.steps, group_hypers(state.optimizer), x, y, strategy.next_key())
        return self._programs[key], args

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        if self.strategy._accumulation_steps != 1:
            raise RuntimeError("train_step runs its own accumulation: pass accumulate=k to train_step() instead of calling it inside strategy.accumulate()")
        requested = export_requested()
        if requested is not None:  # under `loom xla export`: write this step, train nothing, end the script
            out, platforms = requested
            export_step(self, inputs, targets, out, platforms)
            print(f"wrote {out}: the training step lowered for {', '.join(platforms)}", flush=True)
            raise SystemExit(0)
        fn, args = self.program(inputs, targets)
        state = self.state
        state.params, state.buffers, state.slots, state.steps, loss, self.outputs, norm = fn(*args)
        state.device_newer = True
        self.grad_norm = norm if self.max_grad_norm is not None else None
        if self.scheduler is not None:
            with warnings.catch_warnings():  # torch's optimizer.step() never ran: the program made the update
                warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`"))
                self.scheduler.step()
        return to_torch(loss)

    def _compile(self, rules: tuple[GroupRule, ...], micro: int) -> Any:
        import jax

        state = self.state
        plan = state.plan
        p_sh, f_sh, b_sh, s_sh, st_sh = state.shardings()
        batch = plan.batch()
        in_shardings = (p_sh, f_sh, b_sh, s_sh, st_sh, None, batch, batch, plan.replicated())
        out_shardings = (p_sh, b_sh, s_sh, st_sh, plan.replicated(), None, plan.replicated())
        body = _StepBody(self, rules, micro, plan.data_size)
        return jax.jit(body, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=(0, 2, 3, 4))


class _StepBody:
    """The traced function: pure in its arguments, it closes only over the module and the options."""

    def __init__(self, step: XLATrainStep, rules: tuple[GroupRule, ...], micro: int, data_size: int) -> None:
        self.step = step
        self.module = step.state.module
        self.state = step.state
        self.loss_fn = step.loss_fn
        self.max_grad_norm = step.max_grad_norm
        self.rules, self.micro, self.data_size = rules, micro, data_size
        self.autocast = step.strategy.precision.dtype

    def __call__(self, params: Any, frozen: Any, buffers: Any, slots: Any, steps: Any, hypers: Any, x: Any, y: Any, key: Any) -> tuple[Any, ...]:
        import jax
        import jax.numpy as jnp

        grads, loss, outputs = None, 0.0, []
        for i, (xi, yi, weight) in enumerate(self._micro_batches(x, y)):
            loss_of = functools.partial(self._loss, weight=weight)
            (li, (out, buffers)), g = jax.value_and_grad(loss_of, has_aux=True)(params, frozen, buffers, xi, yi, jax.random.fold_in(key, i))
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            loss = loss + li
            outputs.append(out)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        if self.max_grad_norm is not None:
            coef = jnp.minimum(1.0, self.max_grad_norm / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * coef, grads)
        new_params, new_slots, new_steps = {}, {}, {}
        for name, p in params.items():
            group = self.state.group[name]
            new_params[name], new_slots[name], new_steps[name] = update(self.rules[group], hypers[group], p, grads[name], slots[name], steps[name])
        return new_params, buffers, new_slots, new_steps, loss, self._join(outputs), norm

    def _micro_batches(self, x: Any, y: Any) -> list[tuple[Any, Any, float]]:
        """Each device's share split in ``micro`` parts; part i of every device makes micro-batch i."""
        if self.micro == 1:
            return [(x, y, 1.0)]
        import jax

        size = batch_len_of(x if y is None else y) // self.data_size
        bounds = [round(size * i / self.micro) for i in range(self.micro + 1)]

        def part(tree: Any, lo: int, hi: int) -> Any:
            return jax.tree.map(lambda a: a.reshape(self.data_size, size, *a.shape[1:])[:, lo:hi].reshape(-1, *a.shape[1:]), tree)

        return [(part(x, lo, hi), part(y, lo, hi), (hi - lo) / size) for lo, hi in zip(bounds, bounds[1:])]

    def _join(self, outputs: list[Any]) -> Any:
        """Micro-batches' outputs back in the batch's order (device-major, as they were split)."""
        if len(outputs) == 1:
            return outputs[0]
        import jax
        import jax.numpy as jnp

        def join(*parts: Any) -> Any:
            if parts[0].ndim == 0:
                return parts[-1]
            split = [p.reshape(self.data_size, -1, *p.shape[1:]) for p in parts]
            return jnp.concatenate(split, axis=1).reshape(-1, *parts[0].shape[1:])

        return jax.tree.map(join, *outputs)

    def _loss(self, params: Any, frozen: Any, buffers: Any, x: Any, y: Any, key: Any, weight: float) -> tuple[Any, tuple[Any, Any]]:
        """``loss_fn(module(x), y) * weight`` (a micro-batch's share of the batch mean), the outputs and new buffers."""
        env = environment()
        with env.override_property(prng=key, autocast_dtype=self.autocast), env:
            tp, tf, tb, tx, ty = env.j2t_iso((params, frozen, buffers, x, y))
            self.state.tracing = True
            weights = {**tp, **tf, **tb}
            try:
                if self.loss_fn is None:  # the model computes its own loss from the targets
                    out = call_with_targets(lambda *a, **kw: torch.func.functional_call(self.module, weights, a, kw), tx, ty)
                else:
                    out = torch.func.functional_call(self.module, weights, (tx,))
            finally:
                self.state.tracing = False
            if self.autocast is not None:
                out = map_outputs(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
            loss = model_loss(out) if self.loss_fn is None else self.loss_fn(out, ty)
            new_buffers = {name: t.jax() for name, t in tb.items()}
            tensors: list[torch.Tensor] = []  # JAX returns arrays in lists, not in the model's own classes

            def slot(value: Any) -> Any:
                if not isinstance(value, torch.Tensor):
                    return value
                tensors.append(value)
                return _Slot(len(tensors) - 1)

            self.step.skeleton = map_outputs(slot, out)
            return loss.jax() * weight, (env.t2j_iso(tensors), new_buffers)


class _Slot:
    """Where the output's ``index``-th tensor goes back into the model's output."""

    def __init__(self, index: int) -> None:
        self.index = index


def batch_len_of(tree: Any) -> int:
    import jax

    return jax.tree.leaves(tree)[0].shape[0]
