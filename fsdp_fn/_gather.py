"""Gathering units just before they run, and the lifecycle of a gathered unit.

A unit moves through three states in one step (``UnitState``): SHARDED (only this
rank's shard exists) -> GATHERED (its flat buffer holds the full parameters; the unit's
parameters are views into it) -> FREED (forward done, the buffer's storage released)
-> GATHERED again just before its backward -> SHARDED once its gradient is
reduce-scattered. This runs inside ``torch.func.grad``: saved-tensor hooks are refused
there, so instead the buffer's storage is resized to zero after forward, and an identity
``autograd.Function`` on the unit's outputs refills it before the unit's backward runs.
Autograd's saved tensors alias that storage, so gradients stay exact.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.func import functional_call

from fsdp_fn._collectives import _ReduceScatter, all_gather, all_gather_into
from fsdp_fn._functional import Functional
from fsdp_fn._memory import label, retag
from fsdp_fn._plan import ROOT, ParamSpec, Unit, unit_label
from fsdp_fn._shard import Sharded, check_shard, unit_views


def gather_for(unit: str | Unit) -> Callable[[Sharded], dict[str, torch.Tensor]]:
    """A differentiable all-gather of one unit: ``gather_for(unit)(params) -> {name: full}``.

    The full parameters are views into one gathered flat buffer. The backward is the
    reduce-scatter, averaged over ranks (like DDP). Works inside ``torch.func.grad``,
    ``grad_and_value`` and ``vjp``. Memory: the unit's full parameters (padded);
    communication: one all-gather forward, one reduce-scatter backward.
    """
    name = unit.name if isinstance(unit, Unit) else unit

    def gather(params: Sharded) -> dict[str, torch.Tensor]:
        u = params.plan.unit(name)
        full = all_gather(check_shard(params, u), params.group, unit=u.name, grad_scale=1.0 / params.layout.world)
        return unit_views(u, full)

    return gather


class UnitState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard exists; the gathered buffer is not allocated."""
    GATHERED = "gathered"
    """The flat buffer holds the full parameters; forward or backward may use them."""
    FREED = "freed"
    """Forward is done and the buffer's storage is released; backward will refill it."""


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any functorch wrappers (shares storage with ``t``)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


class _Gathered:
    """One gathered instance of a unit inside one call: its buffer and lifecycle state."""

    def __init__(self, unit: Unit, runtime: Runtime) -> None:
        self.unit = unit
        self.runtime = runtime
        self.group = runtime.params.group
        self.state = UnitState.SHARDED
        self.shard: torch.Tensor | None = None  # plain, 1-D
        self.buffer: torch.Tensor | None = None  # plain, 1-D, padded full size

    def gather(self, shard: torch.Tensor) -> None:
        self.shard = shard
        self.state = UnitState.GATHERED
        if self.alone:  # the shard is the whole unit: use it in place, nothing to free later
            self.buffer = shard.view_as(shard)
            return
        with label("gathered"):
            self.buffer = shard.new_empty(shard.numel() * self.group.size())
        all_gather_into(self.buffer, shard, self.group, self.unit.name)

    @property
    def alone(self) -> bool:
        return self.group.size() == 1

    def free(self) -> None:
        assert self.buffer is not None
        if not self.alone:
            self.buffer.untyped_storage().resize_(0)
            self.state = UnitState.FREED

    def refill(self) -> None:
        assert self.buffer is not None
        assert self.shard is not None
        self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
        all_gather_into(self.buffer, self.shard, self.group, self.unit.name)
        self.state = UnitState.GATHERED

    def release(self) -> None:
        """Backward is done with the unit: drop the buffer (autograd holds no views any more)."""
        if self.buffer is not None and self.state is UnitState.GATHERED and not self.alone:
            self.buffer.untyped_storage().resize_(0)
        self.buffer = self.shard = None
        self.state = UnitState.SHARDED


class _GatherUnit(torch.autograd.Function):
    """shard -> full flat buffer; backward: mean reduce-scatter, then the buffer is dropped."""

    @staticmethod
    def forward(shard: torch.Tensor, rec: _Gathered) -> torch.Tensor:
        rec.gather(shard)
        assert rec.buffer is not None
        return rec.buffer if not rec.alone else rec.buffer.view_as(rec.buffer)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.rec = inputs[1]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rec: _Gathered = ctx.rec
        retag(_plain(grad), "grads")
        with label("grads"):
            # The flat gradient comes from the split's backward (a fresh concatenation): ours to reduce into.
            out = _ReduceScatter.apply(grad, rec.group, rec.unit.name, 1.0 / rec.group.size(), True)
        rec.release()
        if rec.runtime.on_grad is None:
            return out, None
        rec.runtime.deliver(rec.unit, _plain(out))
        # The gradient was consumed in place; autograd gets a zero that owns no memory.
        return torch.zeros((), dtype=out.dtype, device=out.device).expand(out.shape), None


class _RefillBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs first in the unit's backward."""

    @staticmethod
    def forward(rec: _Gathered, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.rec = inputs[0]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.rec.state is UnitState.FREED:
            ctx.rec.refill()
        return (None, *grads)


class _NotGathered(torch.Tensor):
    """Stands in for a unit's parameter outside that unit's forward; any use raises."""

    fsdp_fn_where: tuple[str, str]  # (parameter, unit)

    @staticmethod
    def __new__(cls, spec: ParamSpec, unit: str) -> _NotGathered:
        t = torch.Tensor._make_wrapper_subclass(cls, spec.shape, dtype=spec.dtype, device=torch.device("meta"))
        t.fsdp_fn_where = (spec.name, unit)
        return t  # type: ignore[no-any-return]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        me = next(a for a in torch_pytree.tree_leaves((args, kwargs)) if isinstance(a, _NotGathered))
        name, unit = me.fsdp_fn_where
        raise RuntimeError(
            f"parameter {name!r} of unit {unit_label(unit)} was used outside that unit's forward "
            f"({getattr(func, '__name__', func)}); a unit's parameters exist only while its module "
            "runs: call the module (not .forward directly) or put this use in the same unit"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(f"parameter used outside its unit's forward ({func})")


_HARMLESS = {"__get__", "size", "dim", "__repr__", "__format__", "numel", "ndimension"}


class Runtime:
    """Runs a module's forward over sharded parameters, gathering each unit just before it runs.

    Hooks are installed on the units' modules for the duration of ``run`` only.
    """

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        *,
        reshard_after_forward: bool = True,
        on_grad: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        self.fn, self.params = fn, params
        self.reshard_after_forward = reshard_after_forward
        # Called with (unit, gradient shard) once per unit in backward, as soon as the
        # unit's last gathered instance is reduce-scattered (all its uses summed).
        self.on_grad = on_grad
        self.gathers: dict[str, int] = {}  # gathered instances per unit in this forward
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}
        self.plan = params.plan
        self.running: list[str] = []  # units whose forward is in progress, innermost last
        self.order: list[str] = []  # units in the order their forward ran
        self.live: dict[str, list[_Gathered]] = {}  # gathered instances whose forward is running
        module = fn.module
        # where each unit's parameters live in the module: (owning module, attribute, canonical name)
        self.slots: dict[str, list[tuple[nn.Module, str, str]]] = {}
        for unit in self.plan.units:
            slots = []
            for spec in unit.params:
                for full_name in (spec.name, *spec.aliases):
                    owner, _, attr = full_name.rpartition(".")
                    slots.append((module.get_submodule(owner), attr, spec.name))
            self.slots[unit.name] = slots

    def deliver(self, unit: Unit, grad: torch.Tensor) -> None:
        seen, total = self._pending.get(unit.name, (0, None))
        total = grad if total is None else total + grad
        if seen + 1 < self.gathers[unit.name]:
            self._pending[unit.name] = (seen + 1, total)
            return
        self._pending.pop(unit.name, None)
        assert self.on_grad is not None
        with torch._C._DisableFuncTorch(), torch.no_grad():
            self.on_grad(unit.name, total)

    def _gather(self, unit: Unit) -> tuple[_Gathered, dict[str, torch.Tensor]]:
        self.gathers[unit.name] = self.gathers.get(unit.name, 0) + 1
        rec = _Gathered(unit, self)
        full = _GatherUnit.apply(check_shard(self.params, unit), rec)
        return rec, unit_views(unit, full)

    def _after_forward(self, rec: _Gathered, output: Any, reshard: bool) -> Any:
        if not reshard:
            return output
        leaves, spec = torch_pytree.tree_flatten(output)
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        rec.free()
        if idx:
            refilled = _RefillBeforeBackward.apply(rec, *(leaves[i] for i in idx))
            for i, t in zip(idx, refilled, strict=True):
                leaves[i] = t
        return torch_pytree.tree_unflatten(leaves, spec)

    def run(self, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        return self.run_on(self.params, buffers, *args, **kwargs)

    def run_on(self, params: Sharded, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        """Run the module with ``params`` (the runtime's shards, possibly inside a transform)."""
        self.params = params
        module = self.fn.module
        tensors: dict[str, torch.Tensor] = {}
        root: tuple[_Gathered, dict[str, torch.Tensor]] | None = None
        for unit in self.plan.units:
            if unit.name == ROOT:
                root = self._gather(unit)
                tensors.update(root[1])
            else:
                tensors.update({p.name: _NotGathered(p, unit.name) for p in unit.params})
        tensors.update(buffers)

        handles = []
        swapped: list[tuple[nn.Module, str, Any]] = []
        for unit in self.plan.units:
            if unit.name == ROOT:
                continue
            handles.append(module.get_submodule(unit.name).register_forward_pre_hook(self._pre_hook(unit, swapped)))
            handles.append(module.get_submodule(unit.name).register_forward_hook(self._post_hook(unit, swapped)))
        try:
            out = functional_call(module, tensors, args, kwargs, tie_weights=True, strict=False)
        except Exception as e:
            where = f"unit {unit_label(self.running[-1])}" if self.running else "the root unit"
            e.add_note(f"fsdp_fn: raised in the forward of {where}")
            raise
        finally:
            for h in handles:
                h.remove()
            for owner, attr, original in reversed(swapped):
                owner._parameters[attr] = original
            self.running.clear()
        if root is not None:
            out = self._after_forward(root[0], out, reshard=False)
        return out

    def _pre_hook(self, unit: Unit, swapped: list[tuple[nn.Module, str, Any]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(unit.name)
            rec, views = self._gather(unit)
            for owner, attr, name in self.slots[unit.name]:
                swapped.append((owner, attr, owner._parameters[attr]))
                owner._parameters[attr] = views[name]  # type: ignore[assignment]
            self.order.append(unit.name)
            self.live.setdefault(unit.name, []).append(rec)

        return hook

    def _post_hook(self, unit: Unit, swapped: list[tuple[nn.Module, str, Any]]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            for _ in self.slots[unit.name]:
                owner, attr, original = swapped.pop()
                owner._parameters[attr] = original
            self.running.pop()
            return self._after_forward(self.live[unit.name].pop(), output, self.reshard_after_forward)

        return hook


def apply_sharded(
    fn: Functional, params: Sharded, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any
) -> Any:
    """``fn(full_params, buffers, *args, **kwargs)`` computed from sharded ``params``.

    Each unit is all-gathered just before its module runs and, after its forward, its
    gathered buffer is freed until its backward gathers it again; the root unit stays
    gathered for the whole call. Differentiable with ``torch.func``: the gradient with
    respect to ``params`` is the reduce-scattered (rank-averaged) gradient. Memory: shards
    plus the units in flight; communication: one all-gather per unit in forward, one more
    per (non-root) unit in backward, one reduce-scatter per unit in backward.
    """
    return Runtime(fn, params).run(buffers, *args, **kwargs)
