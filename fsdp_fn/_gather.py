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
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.func import functional_call

from fsdp_fn._collectives import Collective, all_gather, all_gather_into, all_reduce_, reduce_scatter_start
from fsdp_fn._functional import Functional
from fsdp_fn._memory import label, retag
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Unit, unit_label
from fsdp_fn._policy import BackwardPrefetch, Schedule
from fsdp_fn._shard import Sharded, check_shard, shards_of, unit_views


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


def predict_collectives(
    plan: Plan, world: int, schedule: Schedule | None = None, *, first_step: bool = True, replicas: int = 1
) -> list[Collective]:
    """What one train step issues on each rank, from the plan alone (for units that run in plan order).

    Per use of a unit (a shared tied parameter is used by each of its modules), per flat
    part (trainable, frozen): one all-gather in forward in the gather dtype; one more in
    backward when the unit is resharded after forward (never the root; from the second
    step on, not the unit that ran last, which is needed again first). Per use, one
    reduce-scatter of the trainable part in the reduce dtype and, with ``replicas``
    (hybrid sharding), one all-reduce of the gradient shard across them. Then one
    all-gather of four float64 numbers per rank (the step's loss, gradient norm and the
    fingerprint of the collectives it issued), and with replicas an all-reduce of two.
    """
    schedule = schedule or Schedule()
    last = [u.name for u in plan.units if u.name != ROOT][-1:]
    out: list[Collective] = []
    for u in plan.units:
        resharded = schedule.reshard_after_forward and u.name != ROOT and (first_step or [u.name] != last)
        parts = [p for p in (u, u.frozen_part) if p.params]
        for _ in u.modules:
            for part in parts:
                n, gather = part.padded_numel(world), schedule.gather_dtype(part.dtype)
                out += [Collective("all_gather", u.name, n, gather, world)] * (1 + resharded)
            if u.params:
                reduce = schedule.reduce_dtype(u.dtype)
                out.append(Collective("reduce_scatter", u.name, u.padded_numel(world), reduce, world))
                if replicas > 1:
                    out.append(Collective("all_reduce", u.name, u.shard_numel(world), reduce, replicas))
    out.append(Collective("all_gather", None, 4 * world, torch.float64, world))
    if replicas > 1:
        out.append(Collective("all_reduce", None, 2, torch.float64, replicas))
    return [c for c in out if c.world > 1]


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


class _Flat:
    """One flat part of a gathered unit: this rank's shard, the gathered buffer, the pending gather."""

    def __init__(self, part: Unit, shard: torch.Tensor, group: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.part, self.shard, self.group = part, shard, group  # shard: plain, 1-D
        self.dtype, self.device = dtype, device
        # One rank, same dtype and device (or nothing to hold): the shard is the whole unit, used in place.
        self.in_place = part.numel == 0 or (group.size() == 1 and shard.dtype == dtype and shard.device == device)
        self.buffer: torch.Tensor | None = None
        self.work: Any = None
        self._source: torch.Tensor | None = None  # the cast/copied shard, alive while its gather runs

    def start(self) -> None:
        if self.in_place:
            self.buffer = self.shard.view_as(self.shard)
            return
        world = self.group.size()
        if self.buffer is None:
            with label("gathered"):
                self.buffer = torch.empty(self.shard.numel() * world, dtype=self.dtype, device=self.device)
        else:
            self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
        source = self.shard
        if world > 1 and (source.dtype != self.dtype or source.device != self.device):
            with label("comm"):
                source = source.to(device=self.device, dtype=self.dtype, non_blocking=True)
        self._source = source
        self.work = all_gather_into(self.buffer, source, self.group, self.part.name, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self._source = None

    def drop(self) -> None:
        self.wait()
        if not self.in_place and self.buffer is not None:
            self.buffer.untyped_storage().resize_(0)


class _Gathered:
    """One gathered instance of a unit inside one call: its flat parts, pending work and state."""

    def __init__(self, unit: Unit, runtime: Runtime) -> None:
        self.unit = unit
        self.runtime = runtime
        self.group = runtime.params.group
        schedule, device = runtime.schedule, runtime.device
        self.parts = [
            _Flat(part, _plain(shard), self.group, schedule.gather_dtype(part.dtype), device or shard.device)
            for part, shard in shards_of(runtime.params, unit)
        ]
        self.state = UnitState.SHARDED
        # Only non-root units whose gather allocates take a buffer that counts against the limit.
        self.counted = unit.name != ROOT and not all(p.in_place for p in self.parts)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard of the trainable part (plain)."""
        return self.parts[0].shard

    def start(self) -> None:
        """Allocate (or re-grow) the buffers and issue the all-gathers; do not wait."""
        # Plain tensors only: a prefetch runs outside any autograd.Function, where a
        # transform would otherwise wrap the new buffers.
        with torch._C._DisableFuncTorch():
            for part in self.parts:
                part.start()
        self.state = UnitState.GATHERED
        self.runtime.inflight += self.counted

    def wait(self) -> None:
        for part in self.parts:
            part.wait()

    def free(self) -> None:
        """After forward: release the storage; backward will ``start`` it again."""
        if all(p.in_place for p in self.parts):
            return  # nothing was allocated
        for part in self.parts:
            part.drop()
        self.runtime.inflight -= self.counted
        self.state = UnitState.FREED

    def release(self) -> None:
        """After backward: autograd holds no views any more; drop everything."""
        if self.state is UnitState.GATHERED:
            for part in self.parts:
                part.drop()
            self.runtime.inflight -= self.counted
        for part in self.parts:
            part.buffer = None
        self.state = UnitState.SHARDED

    def views(self, trainable: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's parameters: views into ``trainable`` (autograd's output) and the frozen buffer."""
        out = unit_views(self.unit, trainable)
        for part in self.parts[1:]:
            assert part.buffer is not None
            out.update(unit_views(part.part, part.buffer))
        return out


class _GatherUnit(torch.autograd.Function):
    """shard -> full flat buffer; backward: mean reduce-scatter, then the buffer is dropped."""

    @staticmethod
    def forward(shard: torch.Tensor, rec: _Gathered) -> torch.Tensor:
        if rec.state is UnitState.SHARDED:  # not prefetched
            rec.start()
        rec.wait()
        buffer = rec.parts[0].buffer
        assert buffer is not None
        return buffer if not rec.parts[0].in_place else buffer.view_as(buffer)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.rec = inputs[1]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rec: _Gathered = ctx.rec
        rt = rec.runtime
        full = _plain(grad)
        retag(full, "grads")
        rec.release()
        rt.after_backward(rec)
        shard = rec.shard
        if rt.deferred is not None:  # accumulating micro-batches: keep the full gradient, reduce later
            with torch._C._DisableFuncTorch(), torch.no_grad():
                rt.defer(rec.unit, full)
        else:
            with torch._C._DisableFuncTorch(), label("grads"):
                finish = rt.reduce(rec.unit, full)
            if rt.on_grad is None:
                return finish(), None
            rt.reductions.append((rec.unit, finish))
            rt.drain(keep=1)  # one reduction in flight behind the next unit's backward
        # The gradient is consumed elsewhere; autograd gets a zero that owns no memory.
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
        deferred: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.fn, self.params = fn, params
        _check_plan_fits(params.plan, fn)
        self.schedule = schedule or Schedule()
        offload = self.schedule.cpu_offload
        self.device = offload.compute_device() if offload is not None else None
        self.plan = params.plan
        # The order units ran in last time: forward prefetch follows it.
        self.order_hint = list(order_hint)
        self._hint_at = -1
        # Called with (unit, gradient shard) once per unit in backward, as soon as the
        # unit's last gathered instance is reduce-scattered (all its uses summed).
        self.on_grad = on_grad
        # Accumulation without reduce-scatter: full gradients per unit, summed over micro-batches.
        self.deferred = deferred
        self.gathers: dict[str, int] = {}  # gathered instances per unit in this forward
        self._sums: dict[str, tuple[int, torch.Tensor]] = {}
        self.reductions: collections.deque[tuple[Unit, Callable[[], torch.Tensor]]] = collections.deque()
        self.records: list[_Gathered] = []  # every gathered instance, in forward order
        self.prefetched: dict[str, _Gathered] = {}
        self.inflight = 0  # non-root unit buffers allocated now
        self.running: list[str] = []  # units whose forward is in progress, innermost last
        self.order: list[str] = []  # units in the order their forward ran
        self.live: dict[tuple[str, str], list[_Gathered]] = {}  # gathered instances whose forward is running
        module = fn.module
        # where each (unit, module) gather puts parameters: (owning module, attribute, canonical name)
        self.slots: dict[tuple[str, str], list[tuple[nn.Module, str, str]]] = {}
        for unit in self.plan.units:
            for path in unit.modules:
                slots = []
                for spec in unit.all_params:
                    for full_name in (spec.name, *spec.aliases):
                        owner, _, attr = full_name.rpartition(".")
                        if not unit.hooks or owner == path:
                            slots.append((module.get_submodule(owner), attr, spec.name))
                self.slots[(unit.name, path)] = slots

    # --- gradients ------------------------------------------------------------------------------

    def reduce(self, unit: Unit, full: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issue the reduce-scatter of a unit's full gradient; the result waits and returns
        the mean gradient shard in the shard's dtype and on its device."""
        layout = self.params.layout
        source = full.to(self.schedule.reduce_dtype(full.dtype))
        finish = reduce_scatter_start(source, layout.group, unit.name, 1.0 / layout.world)
        shard = self.params[unit.name]

        def result() -> torch.Tensor:
            out = finish()
            if layout.replicate is not None:  # hybrid sharding: then average across the replicas
                all_reduce_(out, layout.replicate, unit.name).div_(layout.replicas)
            return out.to(dtype=shard.dtype, device=shard.device)

        return result

    def defer(self, unit: Unit, full: torch.Tensor) -> None:
        assert self.deferred is not None
        total = self.deferred.get(unit.name)
        if total is None:
            self.deferred[unit.name] = full  # a fresh buffer from the split's backward: ours to keep
        else:
            total.add_(full)

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
        check_shard(self.params, unit)
        rec = _Gathered(unit, self)
        self.records.append(rec)
        return rec

    def _gather(self, unit: Unit) -> tuple[_Gathered, dict[str, torch.Tensor]]:
        self.gathers[unit.name] = self.gathers.get(unit.name, 0) + 1
        rec = self.prefetched.pop(unit.name, None) or self._new_record(unit)
        full = _GatherUnit.apply(check_shard(self.params, unit), rec)
        return rec, rec.views(full)

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
        precision = self.schedule.mixed_precision
        if precision.param_dtype is not None and precision.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), precision.param_dtype)
        tensors: dict[str, torch.Tensor] = {}
        for unit in self.plan.units:
            if unit.name == ROOT:
                tensors.update(self._gather(unit)[1])
            else:
                tensors.update({p.name: _NotGathered(p, unit.name) for p in unit.all_params})
        tensors.update(_lift(buffers))
        if self.schedule.forward_prefetch and self.order_hint:
            self._prefetch(self.order_hint[0])

        handles = []
        swapped: list[tuple[nn.Module, str, Any]] = []
        for unit in self.plan.units:
            if unit.name == ROOT:
                continue
            for path in unit.modules:
                target = module.get_submodule(path)
                handles.append(target.register_forward_pre_hook(self._pre_hook(unit, path, swapped)))
                handles.append(target.register_forward_hook(self._post_hook(unit, path, swapped)))
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
        if precision.output_dtype is not None:
            out = _cast_floating(out, precision.output_dtype)
        return out

    def _pre_hook(self, unit: Unit, path: str, swapped: list[tuple[nn.Module, str, Any]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(unit.name)
            rec, views = self._gather(unit)
            upcoming = self._next_in_hint(unit.name)
            if self.schedule.forward_prefetch:
                self._prefetch(upcoming)
            for owner, attr, name in self.slots[(unit.name, path)]:
                swapped.append((owner, attr, owner._parameters[attr]))
                owner._parameters[attr] = views[name]  # type: ignore[assignment]
            self.order.append(unit.name)
            self.live.setdefault((unit.name, path), []).append(rec)

        return hook

    def _post_hook(self, unit: Unit, path: str, swapped: list[tuple[nn.Module, str, Any]]) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            for _ in self.slots[(unit.name, path)]:
                owner, attr, original = swapped.pop()
                owner._parameters[attr] = original
            self.running.pop()
            return self._after_forward(self.live[(unit.name, path)].pop(), output, self._reshard(unit))

        return hook


def _check_plan_fits(plan: Plan, fn: Functional) -> None:
    """The shards' plan must describe this module: same parameter names and shapes."""
    for spec in plan.params:
        have = fn.params.get(spec.name)
        if have is None or tuple(have.shape) != spec.shape:
            found = "no such parameter" if have is None else f"shape {tuple(have.shape)}"
            raise ValueError(
                f"these shards were made for another plan: their parameter {spec.name!r} is {spec.shape} "
                f"(unit {unit_label(plan.unit_of(spec.name).name)}) but {type(fn.module).__name__} has {found}"
            )


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return torch_pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


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
