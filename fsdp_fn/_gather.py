"""Gathering units just before they run, and the lifecycle of a gathered unit.

A unit moves through three states in one step (``UnitState``): SHARDED (only this
rank's shard exists) -> GATHERED (its flat buffer holds the full parameters; the unit's
parameters are views into it) -> FREED (forward done, the buffer's storage released)
-> GATHERED again just before its backward -> SHARDED once its gradient is
reduce-scattered. This runs inside ``torch.func`` transforms: saved-tensor hooks are
refused there, so instead the buffer's storage is resized to zero after forward, and an
identity ``autograd.Function`` on the unit's outputs refills it before the unit's
backward runs. Autograd's saved tensors alias that storage, so gradients stay exact.

Overlap (``Schedule``): all-gathers are issued asynchronously ahead of use, along the
order the previous step ran the units in (forward) and the reverse of this step's order
(backward); a unit waits only for its own gather; with ``update_in_backward`` the
reduce-scatters run behind the next unit's backward too. At most ``max_inflight``
non-root units are gathered at once.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.func import functional_call

from fsdp_fn._collectives import Collective, _ReduceScatter, all_gather, all_gather_into, reduce_scatter_start
from fsdp_fn._functional import Functional
from fsdp_fn._memory import label, retag
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Unit, unit_label
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
    """The flat buffer holds (or, while its all-gather is in flight, will hold) the full parameters."""
    FREED = "freed"
    """Forward is done and the buffer's storage is released; backward will refill it."""


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued in backward (the seed's ``backward_prefetch``)."""

    BACKWARD_PRE = "pre"
    """Before computing this unit's gradients: most overlap, two units gathered at once."""
    BACKWARD_POST = "post"
    """After this unit's gradients are computed (and its reduce-scatter issued)."""


@dataclass(frozen=True)
class Schedule:
    """When units are gathered and freed: a value, the same on every rank."""

    reshard_after_forward: bool = True
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = True
    max_inflight: int = 2  # non-root units gathered at once, prefetches included

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1 (the unit that runs), got {self.max_inflight}")
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {self.backward_prefetch!r}")


def predict_collectives(
    plan: Plan, world: int, schedule: Schedule | None = None, *, first_step: bool = True, trainable: bool = True
) -> list[Collective]:
    """What one train step issues on each rank, from the plan alone (for units that run in plan order).

    Per unit: one all-gather in forward; one more in backward when it is resharded after
    forward (never the root; from the second step on, not the unit that ran last, which
    is needed again first); one reduce-scatter in backward. Then one all-reduce of two
    float64 numbers (the step's loss and gradient norm).
    """
    schedule = schedule or Schedule()
    last = [u.name for u in plan.units if u.name != ROOT][-1:]
    out: list[Collective] = []
    if world == 1:  # one rank communicates nothing
        return out
    for u in plan.units:
        n = u.padded_numel(world)
        out.append(Collective("all_gather", u.name, n, u.dtype, world))
        resharded = schedule.reshard_after_forward and u.name != ROOT and (first_step or [u.name] != last)
        if resharded:
            out.append(Collective("all_gather", u.name, n, u.dtype, world))
        if trainable:
            out.append(Collective("reduce_scatter", u.name, n, u.dtype, world))
    out.append(Collective("all_reduce", None, 2, torch.float64, world))
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any functorch wrappers (shares storage with ``t``)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _lift(buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers as tensors of the current torch.func level, so the forward may update them in
    place (BatchNorm statistics); a transform refuses in-place writes to captured tensors.
    The write still lands in the buffer itself."""
    level = torch._C._functorch.maybe_current_level()
    if level is None:
        return dict(buffers)
    return {k: torch._C._functorch._wrap_for_grad(v, level) for k, v in buffers.items()}


class _Gathered:
    """One gathered instance of a unit inside one call: its buffer, pending work and state."""

    def __init__(self, unit: Unit, runtime: Runtime, shard: torch.Tensor) -> None:
        self.unit = unit
        self.runtime = runtime
        self.group = runtime.params.group
        self.shard = shard  # plain, 1-D
        self.state = UnitState.SHARDED
        self.buffer: torch.Tensor | None = None  # plain, 1-D, padded full size
        self.work: Any = None
        # Only non-root units on more than one rank take a buffer that counts against the limit.
        self.counted = unit.name != ROOT and self.group.size() > 1

    def start(self) -> None:
        """Allocate (or re-grow) the buffer and issue the all-gather; do not wait."""
        # Plain tensors only: a prefetch runs outside any autograd.Function, where a
        # transform would otherwise wrap the new buffer.
        with torch._C._DisableFuncTorch():
            if self.group.size() == 1:  # the shard is the whole unit: use it in place
                self.buffer = self.shard.view_as(self.shard)
            elif self.buffer is None:
                with label("gathered"):
                    self.buffer = self.shard.new_empty(self.shard.numel() * self.group.size())
            else:
                self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
            if self.group.size() > 1:
                self.work = all_gather_into(self.buffer, self.shard, self.group, self.unit.name, async_op=True)
        self.state = UnitState.GATHERED
        self.runtime.inflight += self.counted

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def _drop_storage(self) -> None:
        assert self.buffer is not None
        self.wait()
        if self.group.size() > 1:
            self.buffer.untyped_storage().resize_(0)
        self.runtime.inflight -= self.counted

    def free(self) -> None:
        """After forward: release the storage; backward will ``start`` it again."""
        if self.group.size() == 1:
            return  # nothing was allocated
        self._drop_storage()
        self.state = UnitState.FREED

    def release(self) -> None:
        """After backward: autograd holds no views any more; drop everything."""
        if self.state is UnitState.GATHERED:
            self._drop_storage()
        self.buffer = None
        self.state = UnitState.SHARDED


class _GatherUnit(torch.autograd.Function):
    """shard -> full flat buffer; backward: mean reduce-scatter, then the buffer is dropped."""

    @staticmethod
    def forward(shard: torch.Tensor, rec: _Gathered) -> torch.Tensor:
        if rec.state is UnitState.SHARDED:  # not prefetched
            rec.start()
        rec.wait()
        assert rec.buffer is not None
        return rec.buffer if rec.group.size() > 1 else rec.buffer.view_as(rec.buffer)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.rec = inputs[1]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rec: _Gathered = ctx.rec
        rt = rec.runtime
        retag(_plain(grad), "grads")
        scale = 1.0 / rec.group.size()
        if rt.on_grad is None:
            with label("grads"):
                out = _ReduceScatter.apply(grad, rec.group, rec.unit.name, scale)
            rec.release()
            rt.after_backward(rec)
            return out, None
        with label("grads"):
            finish = reduce_scatter_start(_plain(grad), rec.group, rec.unit.name, scale)
        rec.release()
        rt.after_backward(rec)
        rt.reductions.append((rec.unit, finish))
        rt.drain(keep=1)  # one reduction in flight behind the next unit's backward
        # The gradient is consumed in place by on_grad; autograd gets a zero that owns no memory.
        shard = rec.shard
        return torch.zeros((), dtype=shard.dtype, device=shard.device).expand(shard.shape), None


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
        rec: _Gathered = ctx.rec
        if rec.state is UnitState.FREED:  # not prefetched
            rec.start()
        rec.wait()
        if rec.runtime.schedule.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            rec.runtime.prefetch_backward(rec)
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
        schedule: Schedule | None = None,
        order_hint: Sequence[str] = (),
        on_grad: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        self.fn, self.params = fn, params
        self.schedule = schedule or Schedule()
        self.plan = params.plan
        # The order units ran in last time: forward prefetch follows it.
        self.order_hint = list(order_hint)
        self._hint_at = -1
        # Called with (unit, gradient shard) once per unit in backward, as soon as the
        # unit's last gathered instance is reduce-scattered (all its uses summed).
        self.on_grad = on_grad
        self.gathers: dict[str, int] = {}  # gathered instances per unit in this forward
        self._sums: dict[str, tuple[int, torch.Tensor]] = {}
        self.reductions: collections.deque[tuple[Unit, Callable[[], torch.Tensor]]] = collections.deque()
        self.records: list[_Gathered] = []  # every gathered instance, in forward order
        self.prefetched: dict[str, _Gathered] = {}
        self.inflight = 0  # non-root unit buffers allocated now
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

    # --- gradients ------------------------------------------------------------------------------

    def deliver(self, unit: Unit, grad: torch.Tensor) -> None:
        seen, total = self._sums.pop(unit.name, (0, None))
        total = grad if total is None else total + grad
        if seen + 1 < self.gathers[unit.name]:
            self._sums[unit.name] = (seen + 1, total)
            return
        assert self.on_grad is not None
        with torch._C._DisableFuncTorch(), torch.no_grad():
            self.on_grad(unit.name, total)

    def drain(self, keep: int = 0) -> None:
        """Wait for reduce-scatters issued in backward (oldest first) until ``keep`` are left."""
        while len(self.reductions) > keep:
            unit, finish = self.reductions.popleft()
            self.deliver(unit, finish())

    # --- gathering --------------------------------------------------------------------------------

    def _new_record(self, unit: Unit) -> _Gathered:
        shard = check_shard(self.params, unit)
        rec = _Gathered(unit, self, _plain(shard))
        self.records.append(rec)
        return rec

    def _gather(self, unit: Unit) -> tuple[_Gathered, dict[str, torch.Tensor]]:
        self.gathers[unit.name] = self.gathers.get(unit.name, 0) + 1
        rec = self.prefetched.pop(unit.name, None) or self._new_record(unit)
        full = _GatherUnit.apply(check_shard(self.params, unit), rec)
        return rec, unit_views(unit, full)

    def _next_in_hint(self, name: str) -> str | None:
        hint = self.order_hint
        try:
            self._hint_at = hint.index(name, self._hint_at + 1)
        except ValueError:
            return None
        return hint[self._hint_at + 1] if self._hint_at + 1 < len(hint) else None

    def _prefetch(self, name: str | None) -> None:
        """Start gathering ``name`` (the unit expected to run next) if the limit allows."""
        if name is None or name in self.prefetched or self.inflight >= self.schedule.max_inflight:
            return
        rec = self._new_record(self.plan.unit(name))
        rec.start()
        self.prefetched[name] = rec

    def prefetch_backward(self, rec: _Gathered) -> None:
        """Start refilling the unit whose backward comes next (the previous one in forward order)."""
        if self.inflight >= self.schedule.max_inflight:
            return
        at = self.records.index(rec)
        for earlier in reversed(self.records[:at]):
            if earlier.state is UnitState.FREED:
                earlier.start()
                return

    def after_backward(self, rec: _Gathered) -> None:
        if self.schedule.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self.prefetch_backward(rec)

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

    def _reshard(self, unit: Unit) -> bool:
        if not self.schedule.reshard_after_forward:
            return False
        # The unit that ran last is needed again first: freeing it would only gather it twice.
        return not (self.order_hint and self._hint_at == len(self.order_hint) - 1 and self.order_hint[-1] == unit.name)

    # --- running ------------------------------------------------------------------------------------

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
        tensors.update(_lift(buffers))
        if self.schedule.forward_prefetch and self.order_hint:
            self._prefetch(self.order_hint[0])

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
            for rec in self.prefetched.values():
                rec.release()
            raise
        finally:
            for h in handles:
                h.remove()
            for owner, attr, original in reversed(swapped):
                owner._parameters[attr] = original
            self.running.clear()
        for rec in self.prefetched.values():  # prefetched along the hint, but not run this time
            rec.release()
        self.prefetched.clear()
        return out

    def _pre_hook(self, unit: Unit, swapped: list[tuple[nn.Module, str, Any]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(unit.name)
            rec, views = self._gather(unit)
            upcoming = self._next_in_hint(unit.name)
            if self.schedule.forward_prefetch:
                self._prefetch(upcoming)
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
            return self._after_forward(self.live[unit.name].pop(), output, self._reshard(unit))

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
