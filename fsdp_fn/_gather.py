"""Gathering units just before they run, and the lifecycle of a gathered unit.

Two ways to run a module over shards:

* **composable** (``apply_sharded``, ``gather_for``, and ``value_and_grad`` inside another
  ``torch.func`` transform): each unit is a differentiable all-gather whose backward is the
  reduce-scatter and whose tangent and batching rules are the collective's own, so every
  transform composes (grad of grad, jvp, vmap). Gathered units stay alive as long as
  autograd holds them.
* **lean** (the train step's own pass): a unit moves through ``UnitState``: SHARDED ->
  GATHERED (its flat buffer holds the full parameters; the unit's parameters are views
  into it) -> FREED (forward done, the buffer's storage released) -> GATHERED again just
  before its backward -> SHARDED once its gradient is handed to the ``GradSink``. Inside
  ``torch.func`` saved-tensor hooks are refused, so the buffer's storage is resized to
  zero after forward, and an identity ``autograd.Function`` on the unit's outputs refills
  it before the unit's backward runs; autograd's saved tensors alias that storage.

Overlap (``Schedule``): all-gathers are issued asynchronously ahead of use, along the
order the previous step ran the units in (forward) and the reverse of this step's order
(backward); a unit waits only for its own gather; reduce-scatters run behind the next
unit's backward. At most ``max_inflight`` non-root units are gathered at once.
"""

from __future__ import annotations

import collections
import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.func import functional_call

from fsdp_fn._collectives import Collective, all_gather, all_gather_into, all_reduce_, reduce_scatter_start
from fsdp_fn._functional import Functional, parameters_restored, requires_grad_tolerated
from fsdp_fn._memory import label, retag
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Unit, unit_label
from fsdp_fn._policy import BackwardPrefetch, Schedule
from fsdp_fn._remat import Remat, _remat_with_state, handling_regions, route_torch_checkpoint, save_nothing
from fsdp_fn._shard import Sharded, check_shard, ensure_live, shards_of, unit_views


def gather_for(unit: str | Unit) -> Callable[[Sharded], dict[str, torch.Tensor]]:
    """A differentiable all-gather of one unit: ``gather_for(unit)(params) -> {name: full}``.

    The full parameters are views into one gathered flat buffer. The backward is the
    reduce-scatter, averaged over ranks (like DDP). Works inside ``torch.func.grad``,
    ``grad_and_value`` and ``vjp``. Memory: the unit's full parameters (padded);
    communication: one all-gather forward, one reduce-scatter backward.
    """
    name = unit.name if isinstance(unit, Unit) else unit

    def gather(params: Sharded) -> dict[str, torch.Tensor]:
        ensure_live(params, "gather_for")
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


def metrics_words(plan: Plan) -> int:
    """Float64 numbers each rank contributes to a step's one metrics all-gather: loss, squared
    gradient norm, two for the collective fingerprint, then which parameters got a gradient
    (48 bits per number)."""
    return 4 + -(-sum(len(u.params) for u in plan.units) // 48)


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
    all-gather of ``metrics_words(plan)`` float64 numbers per rank (the step's loss,
    gradient norm, the fingerprint of the collectives it issued and which parameters got
    a gradient), and with replicas an all-reduce of two.
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
    out.append(Collective("all_gather", None, metrics_words(plan) * world, torch.float64, world))
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


# --- the gradient sink: reduce, defer, deliver, drain ------------------------------------------------


class GradSink:
    """Where a unit's full gradient goes when its backward has run (lean path).

    ``push`` issues the unit's reduce-scatter without waiting (one stays in flight behind
    the next unit's backward) and the shards of every use of a unit are summed; with
    ``defer`` (accumulating micro-batches without reducing) the full gradients are summed
    instead and reduced once by ``reduce_deferred``. ``on_unit(unit, grad, received)`` is
    called the moment a unit's last reachable use is reduced (``expect`` says how many
    uses the loss reaches); otherwise ``drain()`` then ``grads()`` hand them over at the end.
    Memory: one gradient shard per unit (or one full gradient per unit with ``defer``),
    plus the full gradients of the reductions in flight.
    """

    def __init__(
        self,
        params: Sharded,
        schedule: Schedule,
        *,
        defer: dict[str, torch.Tensor] | None = None,
        on_unit: Callable[[str, torch.Tensor, tuple[bool, ...]], None] | None = None,
    ) -> None:
        self.params, self.schedule = params, schedule
        self.deferred = defer
        self.on_unit = on_unit
        self.totals: dict[str, torch.Tensor] = {}
        self.received: dict[str, list[bool]] = {}
        self.expected: dict[str, int] = {}
        self.arrived: collections.Counter[str] = collections.Counter()
        self.pending: collections.deque[tuple[str, Callable[[], torch.Tensor]]] = collections.deque()
        self.delivered: list[str] = []  # units handed to on_unit, in order

    def expect(self, uses: Mapping[str, int]) -> None:
        """How many gathered uses of each unit the loss reaches (the others never get a backward)."""
        self.expected = dict(uses)

    def push(self, unit: Unit, full: torch.Tensor, received: Sequence[bool]) -> None:
        mask = self.received.setdefault(unit.name, [False] * len(unit.params))
        for i, got in enumerate(received):
            mask[i] = mask[i] or got
        with torch._C._DisableFuncTorch(), torch.no_grad():
            if self.deferred is not None:
                total = self.deferred.get(unit.name)
                if total is None:
                    self.deferred[unit.name] = full  # a fresh buffer from the split's backward: ours to keep
                else:
                    total.add_(full)
                return
            with label("grads"):
                self.pending.append((unit.name, reduce_unit(self.params, unit, full, self.schedule)))
        self.drain(keep=1)

    def drain(self, keep: int = 0) -> None:
        """Wait for reduce-scatters (oldest first) until ``keep`` are left in flight."""
        while len(self.pending) > keep:
            unit, finish = self.pending.popleft()
            with torch._C._DisableFuncTorch(), torch.no_grad():
                self._deliver(unit, finish())

    def _deliver(self, unit: str, grad: torch.Tensor) -> None:
        total = self.totals.get(unit)
        self.totals[unit] = grad if total is None else total.add_(grad)
        self.arrived[unit] += 1
        if self.on_unit is not None and self.arrived[unit] == self.expected.get(unit, 0):
            self.delivered.append(unit)
            self.on_unit(unit, self.totals.pop(unit), tuple(self.received[unit]))

    def reduce_deferred(self) -> None:
        """``defer``: reduce-scatter every unit's summed full gradient once, now."""
        assert self.deferred is not None
        plan = self.params.plan
        for name in list(self.deferred):
            with torch._C._DisableFuncTorch(), torch.no_grad():
                finish = reduce_unit(self.params, plan.unit(name), self.deferred.pop(name), self.schedule)
                self._deliver(name, finish())

    def received_masks(self) -> dict[str, tuple[bool, ...]]:
        return {u: tuple(m) for u, m in self.received.items()}


def reduce_unit(params: Sharded, unit: Unit, full: torch.Tensor, schedule: Schedule) -> Callable[[], torch.Tensor]:
    """Issue the reduce-scatter of a unit's full gradient (in the schedule's reduce dtype);
    the result waits and returns the rank-mean gradient shard, averaged across replicas
    too with hybrid sharding, in the shard's dtype and on its device."""
    layout = params.layout
    source = full.to(schedule.reduce_dtype(full.dtype))
    finish = reduce_scatter_start(source, layout.group, unit.name, 1.0 / layout.world)
    shard = params[unit.name]

    def result() -> torch.Tensor:
        out = finish()
        if layout.replicate is not None:
            all_reduce_(out, layout.replicate, unit.name).div_(layout.replicas)
        return out.to(dtype=shard.dtype, device=shard.device)

    return result


# --- a gathered unit (lean path) -------------------------------------------------------------------


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
    """One gathered use of a unit inside one call: its flat parts, pending work, state, and
    which of its parameters the backward reached."""

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
        self.received = [False] * len(unit.params)
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
        """After backward (or when no backward will come): drop everything."""
        if self.state is UnitState.GATHERED:
            for part in self.parts:
                part.drop()
            self.runtime.inflight -= self.counted
        for part in self.parts:
            part.buffer = None
        self.state = UnitState.SHARDED

    def views(self, trainable: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's parameters: views into ``trainable`` (autograd's output), each marked so
        the backward records whether it reached that parameter; frozen ones from their buffer."""
        out = unit_views(self.unit, trainable)
        if torch.is_grad_enabled():
            for i, spec in enumerate(self.unit.params):
                out[spec.name] = _MarkReached.apply(out[spec.name], self, i)
        for part in self.parts[1:]:
            assert part.buffer is not None
            out.update(unit_views(part.part, part.buffer))
        return out


class _GatherUnit(torch.autograd.Function):
    """shard -> full flat buffer; backward: the full gradient goes to the runtime's ``GradSink``."""

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
        ctx.fsdp_fn_use = inputs[1]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rec: _Gathered = ctx.fsdp_fn_use
        runtime = rec.runtime
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fsdp_fn: a second derivative (or a backward with create_graph=True) through the train step's "
                "lean gathering is not supported: its reduce-scatter is not differentiable; use apply_sharded or "
                "value_and_grad inside your transform (their gathers compose with every torch.func transform)"
            )
        full = _plain(grad)
        retag(full, "grads")
        rec.release()
        runtime.after_backward(rec)
        runtime.sink.push(rec.unit, full, rec.received)
        shard = rec.shard
        # The gradient travels through the sink; autograd gets a zero that owns no memory.
        return torch.zeros((), dtype=shard.dtype, device=shard.device).expand(shard.shape), None


class _MarkReached(torch.autograd.Function):
    """Identity on one parameter's view; its backward records that the loss reached the parameter."""

    @staticmethod
    def forward(view: torch.Tensor, rec: _Gathered, index: int) -> torch.Tensor:
        return view.view_as(view)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.rec, ctx.index = inputs[1], inputs[2]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.rec.received[ctx.index] = True
        return grad, None, None


class _RefillBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs first in the unit's backward."""

    @staticmethod
    def forward(rec: _Gathered, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.fsdp_fn_refill = inputs[0]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        rec: _Gathered = ctx.fsdp_fn_refill
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


_MISSING = object()

Swapped = list[tuple[nn.Module, str, Any]]  # (owner, attribute, original parameter) put back after the call

_HARMLESS = {"__get__", "size", "dim", "__repr__", "__format__", "numel", "ndimension"}


class Runtime:
    """Runs a module's forward over sharded parameters, gathering each unit just before it runs.

    ``composable=True``: each unit is a differentiable all-gather (any transform composes).
    Otherwise the lean path: gathered buffers are freed after forward and refilled before
    backward, gradients go to ``sink``. Hooks are installed on the units' modules for the
    duration of ``run`` only.
    """

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        *,
        schedule: Schedule | None = None,
        order_hint: Sequence[str] = (),
        sink: GradSink | None = None,
        composable: bool = False,
        remat: Remat | None = None,
    ) -> None:
        ensure_live(params, "apply_sharded")
        self.fn, self.params = fn, params
        _check_plan_fits(params.plan, fn)
        self.schedule = schedule or Schedule()
        self.composable = composable
        self.sink = sink if sink is not None else GradSink(params, self.schedule)
        offload = self.schedule.cpu_offload
        self.device = offload.compute_device() if offload is not None else None
        self.plan = params.plan
        # The order units ran in last time: forward prefetch follows it.
        self.order_hint = list(order_hint)
        self._hint_at = -1
        self.uses: dict[str, int] = {}  # gathered uses per unit in this forward
        self.records: list[_Gathered] = []  # every gathered use that may get a backward, in forward order
        self.prefetched: dict[str, _Gathered] = {}
        self.inflight = 0  # non-root unit buffers allocated now
        self.running: list[str] = []  # units whose forward is in progress, innermost last
        self.order: list[str] = []  # units in the order their forward ran
        self.live: dict[tuple[str, int], list[_Gathered | None]] = {}  # uses whose forward is running
        module = fn.module
        # Each unit's modules, one entry per module object (a module shared under several
        # paths is hooked once), and where a gather puts its parameters in it.
        self.targets: dict[str, list[nn.Module]] = {}
        self.slots: dict[tuple[str, int], list[tuple[nn.Module, str, str]]] = {}
        for unit in self.plan.units:
            seen: dict[int, nn.Module] = {}
            for path in unit.modules:
                target = module.get_submodule(path)
                seen.setdefault(id(target), target)
                slots = self.slots.setdefault((unit.name, id(target)), [])
                for spec in unit.all_params:
                    for full_name in (spec.name, *spec.aliases):
                        owner, _, attr = full_name.rpartition(".")
                        if not unit.hooks or owner == path:
                            slot = (module.get_submodule(owner), attr, spec.name)
                            if not any(s[0] is slot[0] and s[1] == attr for s in slots):
                                slots.append(slot)
            self.targets[unit.name] = list(seen.values())
        # Units that can be rematerialised run through a forward of ours for the call: the
        # ones ``remat`` selects, and the ones a torch.utils.checkpoint region asks for.
        self.own_unit: dict[int, Unit] = {
            id(module.get_submodule(u.name)): u for u in self.plan.units if u.name != ROOT and not u.hooks
        }
        self.remat = remat
        self.remat_units = remat.selects(self.plan, module) if remat is not None else frozenset()
        for name in self.remat_units:
            self._check_rematerialisable(self.plan.unit(name), "train_step(remat=...)")
        self.forced: set[str] = set()  # units a routed torch checkpoint region rematerialises now

    # --- rematerialisation -------------------------------------------------------------------------

    def _check_rematerialisable(self, unit: Unit, asked_by: str) -> None:
        """A rematerialised unit is recomputed in backward, after this call's hooks are gone:
        every parameter it reads must be its own (another unit's would not be gathered then)."""
        module = self.fn.module.get_submodule(unit.name)
        own = {spec.name for spec in unit.all_params} | {a for spec in unit.all_params for a in spec.aliases}
        prefix = f"{unit.name}."
        for name, _ in module.named_parameters(remove_duplicate=False):
            full = prefix + name
            if full not in own:
                other = self.plan.unit_of(full).name
                raise ValueError(
                    f"{asked_by}: unit {unit_label(unit.name)} cannot be rematerialised: it reads parameter "
                    f"{full!r} of unit {unit_label(other)}, which is not gathered when the unit is recomputed in "
                    "backward; rematerialise the units inside it instead (or put that parameter in this unit)"
                )

    def _forward(self, unit: Unit, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The unit's forward for this call: rematerialised when asked, otherwise the module's own."""
        if unit.name in self.forced:
            return _remat_with_state(original, [self.fn.module.get_submodule(unit.name)], save_nothing, unit.name)(
                *args, **kwargs
            )
        if unit.name in self.remat_units:
            assert self.remat is not None
            module = self.fn.module.get_submodule(unit.name)
            return _remat_with_state(original, [module], self.remat.policy, unit.name)(*args, **kwargs)
        return original(*args, **kwargs)

    def _region(
        self, function: Callable[..., Any], modules: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A torch.utils.checkpoint region inside this call: the units it names are rematerialised
        by their own forward (with their gathered parameters); other regions go to ``remat``."""
        units = [self.own_unit[id(m)] for m in modules if id(m) in self.own_unit]
        if not units:
            return NotImplemented
        for unit in units:
            self._check_rematerialisable(unit, f"torch.utils.checkpoint.checkpoint of unit {unit_label(unit.name)}")
        added = [u.name for u in units if u.name not in self.forced]
        self.forced.update(added)
        try:
            return function(*args, **kwargs)
        finally:
            self.forced.difference_update(added)

    # --- gathering ---------------------------------------------------------------------------------

    def _new_record(self, unit: Unit) -> _Gathered:
        check_shard(self.params, unit)
        rec = _Gathered(unit, self)
        self.records.append(rec)
        return rec

    def _gather(self, unit: Unit) -> tuple[_Gathered | None, dict[str, torch.Tensor]]:
        self.uses[unit.name] = self.uses.get(unit.name, 0) + 1
        if self.composable:
            return None, self._gather_composable(unit)
        rec = self.prefetched.pop(unit.name, None) or self._new_record(unit)
        full = _GatherUnit.apply(check_shard(self.params, unit), rec)
        return rec, rec.views(full)

    def _gather_composable(self, unit: Unit) -> dict[str, torch.Tensor]:
        layout = self.params.layout
        out: dict[str, torch.Tensor] = {}
        for part, shard in shards_of(self.params, unit):
            source = shard.to(dtype=self.schedule.gather_dtype(part.dtype), device=self.device or shard.device)
            if part is unit:
                full = all_gather(source, layout.group, unit=unit.name, grad_scale=1.0 / layout.world)
            else:  # frozen: a constant
                with torch.no_grad():
                    full = all_gather(source.detach(), layout.group, unit=unit.name)
            out.update(unit_views(part, full))
        return out

    def _next_in_hint(self, name: str) -> str | None:
        hint = self.order_hint
        try:
            self._hint_at = hint.index(name, self._hint_at + 1)
        except ValueError:
            return None
        return hint[self._hint_at + 1] if self._hint_at + 1 < len(hint) else None

    def _prefetch(self, name: str | None) -> None:
        """Start gathering ``name`` (the unit expected to run next) if the limit allows."""
        if self.composable or name is None or name in self.prefetched or self.inflight >= self.schedule.max_inflight:
            return
        rec = self._new_record(self.plan.unit(name))
        rec.start()
        self.prefetched[name] = rec

    def prefetch_backward(self, rec: _Gathered) -> None:
        """Start refilling the unit whose backward comes next (the previous one in forward order)."""
        if self.inflight >= self.schedule.max_inflight or rec not in self.records:
            return
        at = self.records.index(rec)
        for earlier in reversed(self.records[:at]):
            if earlier.state is UnitState.FREED:
                earlier.start()
                return

    def after_backward(self, rec: _Gathered) -> None:
        if self.schedule.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self.prefetch_backward(rec)
        if rec in self.records:
            self.records.remove(rec)  # done: backward prefetch looks only at uses still to come

    def _after_forward(self, rec: _Gathered | None, output: Any, reshard: bool) -> Any:
        if rec is None or not reshard:
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

    def finish_forward(self, loss: torch.Tensor) -> None:
        """The loss is known: find the gathered uses its backward will reach (walking autograd's
        graph), tell the sink how many per unit, and release the others now (a no-grad call,
        an output thrown away): they will never get a backward, so backward must not refill them."""
        gathers: set[int] = set()  # uses whose gradient the backward computes
        needed: set[int] = set()  # uses whose gathered parameters the backward reads
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            use = getattr(node, "fsdp_fn_use", None)
            if use is not None:
                gathers.add(id(use))
            refill = getattr(node, "fsdp_fn_refill", None)
            if refill is not None:
                needed.add(id(refill))
            stack.extend(next_node for next_node, _ in node.next_functions)
        uses: collections.Counter[str] = collections.Counter()
        for rec in list(self.records):
            if id(rec) in gathers:
                uses[rec.unit.name] += 1
            elif id(rec) not in needed and (rec.state is UnitState.FREED or not rec.unit.frozen):
                # (a gathered frozen part may be read by the backward through its own views)
                rec.release()
                self.records.remove(rec)
        self.sink.expect(uses)

    def release_all(self) -> None:
        """After backward: drop what is left (units with only frozen parameters get no gradient,
        so nothing released them when their backward was done)."""
        for rec in self.records:
            rec.release()
        self.records.clear()

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
        first_record = len(self.records)
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
            for target in self.targets[unit.name]:
                handles.append(target.register_forward_pre_hook(self._pre_hook(unit, target, swapped)))
                handles.append(target.register_forward_hook(self._post_hook(unit, target, swapped)))
        forwards: list[tuple[nn.Module, Any]] = []  # (module, its own instance-level forward or _MISSING)
        for unit in self.own_unit.values():
            target = module.get_submodule(unit.name)
            forwards.append((target, target.__dict__.get("forward", _MISSING)))
            target.forward = functools.partial(self._forward, unit, target.forward)
        try:
            with (
                parameters_restored(module),
                route_torch_checkpoint(),
                handling_regions(self._region),
                requires_grad_tolerated(),
            ):
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
            for target, forward in forwards:
                if forward is _MISSING:
                    del target.forward
                else:
                    target.forward = forward
            for owner, attr, original in reversed(swapped):
                owner._parameters[attr] = original
            self.running.clear()
        for rec in self.prefetched.values():  # prefetched along the hint, but not run this time
            rec.release()
            self.records.remove(rec)
        self.prefetched.clear()
        if not torch.is_grad_enabled():  # an evaluation call: nothing of it will get a backward
            for rec in self.records[first_record:]:
                rec.release()
            del self.records[first_record:]
        if precision.output_dtype is not None:
            out = _cast_floating(out, precision.output_dtype)
        return out

    def _pre_hook(
        self, unit: Unit, target: nn.Module, swapped: list[tuple[nn.Module, str, Any]]
    ) -> Callable[..., None]:
        key = (unit.name, id(target))

        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(unit.name)
            rec, views = self._gather(unit)
            upcoming = self._next_in_hint(unit.name)
            if self.schedule.forward_prefetch:
                self._prefetch(upcoming)
            for owner, attr, name in self.slots[key]:
                swapped.append((owner, attr, owner._parameters[attr]))
                owner._parameters[attr] = views[name]  # type: ignore[assignment]
            self.order.append(unit.name)
            self.live.setdefault(key, []).append(rec)

        return hook

    def _post_hook(
        self, unit: Unit, target: nn.Module, swapped: list[tuple[nn.Module, str, Any]]
    ) -> Callable[..., Any]:
        key = (unit.name, id(target))

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            for _ in self.slots[key]:
                owner, attr, original = swapped.pop()
                owner._parameters[attr] = original
            self.running.pop()
            return self._after_forward(self.live[key].pop(), output, self._reshard(unit))

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

    Each unit is all-gathered just before its module runs, by the differentiable
    all-gather of ``gather_for``: the gradient with respect to ``params`` is the
    reduce-scattered (rank-averaged) gradient, and every ``torch.func`` transform composes
    (``grad``, ``vjp``, ``jvp``, ``vmap``, grad of grad) as does plain ``.backward()`` when
    the shards require grad. Memory: shards plus every unit gathered so far (autograd keeps
    them for the backward; the train step's own pass frees them instead); communication:
    one all-gather per unit use in forward, one reduce-scatter per use in backward.
    """
    return Runtime(fn, params, composable=True).run(buffers, *args, **kwargs)
