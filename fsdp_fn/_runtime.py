"""One call of a module over shards: the hooks installed for it, the module run, each unit's forward.

``Runtime`` is the state of one call, as FSDP2's ``FSDPState`` is a module's: it installs a
pre-forward and a post-forward hook on each unit's modules for the duration of ``run`` only
(a wrapper around a compiled unit's compiled code instead), puts the gathered parameters in
place around each unit's forward and takes them out after it, dispatches rematerialisation,
and leaves the module as it was. What a unit's forward gathers, and what happens to it
after, is the subclass's:

* ``LeanRuntime`` (``_lean.py``): the train step's own pass. Each use of a unit goes through
  the lifecycle of ``_unit.py`` (gathered, freed after its forward, refilled before its
  backward), gathers are prefetched, gradients go to a ``GradSink``.
* ``ComposableRuntime`` (``_composable.py``): ``apply_sharded``, and ``value_and_grad``
  inside another ``torch.func`` transform. Each unit is the differentiable all-gather of
  ``gather_for``, so every transform composes.

What is the same at every call is worked out once (``_wiring.py``).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn

from fsdp_fn._function import plain
from fsdp_fn._functional import Functional, parameters_restored, requires_grad_tolerated
from fsdp_fn._lookup import LookupChoice
from fsdp_fn._phases import phased
from fsdp_fn._plan import ROOT, Unit, unit_label
from fsdp_fn._policy import Schedule
from fsdp_fn._remat import Remat, RematError, SavePolicy, route_torch_checkpoint, save_nothing
from fsdp_fn._remat._function import _describe, _remat_with_state, outside_region
from fsdp_fn._remat._routing import handling_regions
from fsdp_fn._remat._state import _installed, _state_slots
from fsdp_fn._shard import Sharded, check_shard, ensure_live
from fsdp_fn._tp import FIXED_HEADS, split_modules
from fsdp_fn._unit import GatheredUnit
from fsdp_fn._wiring import Wiring, check_rematerialisable


class Phase(enum.Enum):
    """Where one call over shards is."""

    IDLE = "idle"
    """Made; the module has not run."""
    FORWARD = "forward"
    """The module runs (``run``), or ran and its loss is not known yet."""
    BACKWARD = "backward"
    """The loss is known (``finish_forward``): a backward from now on is the step's own."""
    DONE = "done"
    """The backward is over (``finalize_backward``) or was abandoned: nothing is gathered."""


_MISSING = object()
_DEFAULT_SCHEDULE = Schedule()
FETCHING = "fetching rows"  # a use that gathers nothing: a lookup whose forward fetches its rows
JOINED = "joined"  # a group's module running inside the group's open gather (``Unit.members``)


class Region:
    """A rematerialised region of one call whose function calls units of its own (a unit with units
    inside, a torch.utils.checkpoint of a closure that calls units): those units' trainable shards
    are inputs of the region, and each run of it (its forward, each recomputation in backward)
    gathers them from the shards that run sees, so the recomputation gathers them again."""

    __slots__ = ("nodes", "runs", "units", "uses")

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = units  # the units its modules hold that are not gathered when it starts
        self.runs = 0  # how many times it has run: the first is its forward
        self.uses: collections.Counter[str] = collections.Counter()  # its forward's gathered uses per unit
        self.nodes = range(0)  # the numbers of the autograd nodes its call made (its own among them)


class RegionRun(NamedTuple):
    """One run of a ``Region``: the shards its units gather from, and whether it is a recomputation."""

    region: Region
    shards: dict[str, torch.Tensor]
    again: bool


class Runtime:
    """One call of a module over sharded parameters, gathering each unit just before it runs.

    Hooks are installed on the units' modules for the duration of ``run`` only. Subclasses
    say what a unit's forward gathers (``_enter_unit``) and what happens to it after
    (``_leave_unit``).
    """

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        *,
        schedule: Schedule | None = None,
        remat: Remat | None = None,
        check_unchanged: bool = False,
        compile: Mapping[str, Any] | None = None,
        composable: bool = False,
        deferred: bool = False,
    ) -> None:
        ensure_live(params, "apply_sharded")
        self.fn, self.params = fn, params
        self.phase = Phase.IDLE
        # Whether each unit's forward is checked for changing its gathered parameters in place
        # (a fingerprint of them before and after: one read of the unit more, no communication).
        self.check_unchanged = check_unchanged
        self.fingerprints: dict[tuple[str, int], list[tuple[dict[str, int], dict[str, torch.Tensor]]]] = {}
        self.schedule = schedule or _DEFAULT_SCHEDULE
        self.wiring = wiring = Wiring.of(fn, params, self.schedule, remat, composable, deferred, compile)
        offload = self.schedule.cpu_offload
        self.device = offload.compute_device() if offload is not None else None
        self.plan = params.plan
        self.uses: dict[str, int] = {}  # gathered uses per unit in this call
        self.running: list[str] = []  # units whose forward is in progress, innermost last
        self.order: list[str] = []  # units in the order their forward ran
        # (unit, module) -> its uses whose forward runs now: what ``_enter_unit`` gathered (or
        # FETCHING), and autograd's node count at its start
        self.live: dict[tuple[str, int], list[tuple[Any, int]]] = {}
        # group units (``Unit.members``) gathered now: [use, views, node count at the gather, last output]
        self.open: dict[str, list[Any]] = {}
        self.targets, self.slots, self.own_unit = wiring.targets, wiring.slots, wiring.own_unit
        self.modules = wiring.modules
        self.remat = remat
        self.remat_units = wiring.remat_units
        self.forced: set[str] = set()  # units a routed torch checkpoint region rematerialises now
        self.lookups = LookupChoice(wiring.lookups, self.modules, wiring.row_lookups, self.remat_units)
        # what the next ``run_on`` calls instead of the module: (submodule path, method or None)
        self.target: tuple[str, str | None] | None = None
        self.hooks: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # a unit module's, for a method
        self.hooked = False  # the units' hooks are installed (during ``run_on``, or a region's recomputation)
        self.regions: list[RegionRun] = []  # the regions over units running now, innermost last
        self.region_calls: list[Region] = []  # the outermost such regions this call ran, in order

    # --- what subclasses say -----------------------------------------------------------------------

    def _gather(self, unit: Unit) -> tuple[GatheredUnit | None, dict[str, torch.Tensor]]:
        """Gather ``unit`` for the forward that starts now: its use (if it has a lifecycle) and
        its parameters by name."""
        raise NotImplementedError

    def _enter_unit(self, unit: Unit, args: Any, kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """A unit's forward starts: what it gathered and its parameters by name, or None when it
        gathers nothing (a lookup that fetches its rows)."""
        return self._gather(unit)

    def _entered(self, unit: Unit, use: Any, args: Any, kwargs: Any) -> None:
        """The unit's parameters are in place and its forward is about to run."""

    def _leave_unit(self, unit: Unit, use: Any, output: Any, nodes_before: int) -> Any:
        """A unit's forward has run and its parameters are out again: the output, as the caller sees it."""
        return output

    def _fetches_rows(self, unit: Unit) -> bool:
        """Whether this call of ``unit`` fetches its rows instead of gathering its table (not inside
        a region over units, whose recomputation gathers what it calls)."""
        return not self.regions and self.lookups.fetches_rows(unit.name, self.forced)

    def _lookup(self, unit: Unit, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def _starting(self) -> None:
        """The module is about to run (the root is gathered)."""

    def _failed(self) -> None:
        """The module's forward raised."""

    def _finished(self) -> None:
        """The module's forward returned."""

    # --- rematerialisation -------------------------------------------------------------------------

    def _forward(self, unit: Unit, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The forward of ``unit``'s module (one of a group's) for this call: rematerialised
        when asked, a lookup of fetched rows, otherwise the module's own."""
        if self._fetches_rows(unit):
            return self._lookup(unit, *args, **kwargs)
        if unit.name in self.forced:
            return self._rematerialised(original, [module], save_nothing, unit.name)(*args, **kwargs)
        if unit.name in self.remat_units:
            assert self.remat is not None
            return self._rematerialised(original, [module], self.remat.policy, unit.name)(*args, **kwargs)
        return original(*args, **kwargs)

    def _rematerialised(
        self, fn: Callable[..., Any], modules: Sequence[nn.Module], policy: SavePolicy, where: str
    ) -> Callable[..., Any]:
        """``remat(fn)`` inside this call, the parameters and buffers of ``modules`` in place now its
        inputs. The units inside ``modules`` that are not gathered now are ``fn``'s to gather: their
        trainable shards are inputs too, and each run of the region gathers them (its forward, and
        the recomputation in backward, with their hooks installed again for it). Memory: the
        region's inputs, by reference; communication: one all-gather of each such unit use in the
        forward and one in the recomputation (kept until its backward), one reduce-scatter. Under
        tensor parallelism the recomputation runs the split modules' collectives again, as the
        forward did (their hooks are gone by then)."""
        if self.plan.tensor is not None:
            fn = _within(self._split_modules, fn)
        running = set(self.running)
        units = [u for u in self.wiring.units_within(modules) if u.name not in running]
        if not units:
            return _remat_with_state(fn, modules, policy, where)
        region = Region(units)
        rematerialised = _remat_with_state(
            fn,
            modules,
            policy,
            where,
            (lambda: [self._shard_for(u) for u in units], functools.partial(self._region_run, region)),
        )

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            outermost = not self.regions
            before = torch._C._autograd._get_sequence_nr()
            out = rematerialised(*args, **kwargs)
            if outermost:
                region.nodes = range(before, torch._C._autograd._get_sequence_nr())
                self.region_calls.append(region)
            return out

        return call

    @contextlib.contextmanager
    def _region_run(self, region: Region, shards: Sequence[torch.Tensor]) -> Iterator[None]:
        """One run of ``region``: its units gather from ``shards`` (the region's inputs, as this run
        sees them). A recomputation after this call's hooks are gone installs its units' again."""
        again = region.runs > 0
        region.runs += 1
        self.regions.append(RegionRun(region, dict(zip((u.name for u in region.units), shards, strict=True)), again))
        try:
            if self.hooked:
                yield
            else:
                with (
                    self._hooks(region.units),
                    parameters_restored(self.fn.module),
                    route_torch_checkpoint(),
                    handling_regions(self._region),
                    requires_grad_tolerated(),
                ):
                    yield
        finally:
            self.regions.pop()

    @property
    def _recomputing(self) -> bool:
        """Whether a region over units is being recomputed now (in backward)."""
        return any(run.again for run in self.regions)

    def _shard_for(self, unit: Unit) -> torch.Tensor:
        """The trainable shard ``unit`` gathers from: the innermost running region's input for it,
        if one gathers it, else the call's."""
        for run in reversed(self.regions):
            shard = run.shards.get(unit.name)
            if shard is not None:
                return shard
        return check_shard(self.params, unit)

    def _region(
        self, function: Callable[..., Any], modules: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A torch.utils.checkpoint region inside this call: the units it names are rematerialised
        by their own forward (with their gathered parameters); a region that calls units of its
        modules (a closure, another module's method) is rematerialised here, gathering them in
        each run; other regions go to ``remat``."""
        units = [self.own_unit[id(m)] for m in modules if id(m) in self.own_unit]
        if not units:
            if not self.wiring.units_within(modules):
                return NotImplemented
            return self._rematerialised(function, modules, save_nothing, _describe(function))(*args, **kwargs)
        for unit in units:
            check_rematerialisable(
                self.fn,
                self.plan,
                unit,
                f"torch.utils.checkpoint.checkpoint of unit {unit_label(unit.name)}",
                any(id(t) in self.wiring.compiled for t in self.targets[unit.name]),
            )
        added = [u.name for u in units if u.name not in self.forced]
        self.forced.update(added)
        try:
            return function(*args, **kwargs)
        finally:
            self.forced.difference_update(added)

    # --- running ------------------------------------------------------------------------------------

    def run(self, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        return self.run_on(self.params, buffers, *args, **kwargs)

    def run_on(self, params: Sharded, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        """Run the module with ``params`` (the runtime's shards, possibly inside a transform);
        with ``self.target`` set (``ModelHandle``), one of its submodules or methods instead."""
        self.params = params
        self.phase = Phase.FORWARD
        module = self.fn.module
        precision = self.schedule.mixed_precision
        args, kwargs = precision.cast_inputs(args, kwargs)
        tensors: dict[str, torch.Tensor] = dict(self.wiring.standins)
        root: tuple[dict[str, int], dict[str, torch.Tensor]] = ({}, {})
        if ROOT in self.modules:
            views = self._gather(self.plan.unit(ROOT))[1]
            root = (_fingerprints(views) if self.check_unchanged else {}, views)
            tensors.update(views)
        tensors.update(_lift(buffers))
        self._starting()
        try:
            with (
                self._split_modules(),
                self._hooks(u for u in self.plan.units if u.name != ROOT),
                parameters_restored(module),
                route_torch_checkpoint(),
                handling_regions(self._region),
                requires_grad_tolerated(),
            ):
                for owner, attr, name, is_param in self.wiring.swaps:  # what functional_call does, wired once
                    value = tensors.get(name)
                    if value is not None:
                        (owner._parameters if is_param else owner._buffers)[attr] = value  # type: ignore[index,assignment]
                out = module(*args, **kwargs) if self.target is None else self._call_target(args, kwargs)
                self._close_groups()
            _check_unchanged(ROOT, *root)
        except Exception as e:
            where = f"unit {unit_label(self.running[-1])}" if self.running else "the root unit"
            e.add_note(f"fsdp_fn: raised in the forward of {where}")
            if self.plan.tensor is not None and "is invalid for input of size" in str(e):
                e.add_note(
                    f"fsdp_fn: in the forward of {where}, " + FIXED_HEADS.format(share=f"1/{self.plan.tensor.size}")
                )
            if "_ParamView is a view and its base" in str(e):  # autograd's words for it, under no_grad
                e.add_note(f"fsdp_fn: the forward of {where} changed one of its parameters in place; {_LOST}")
            self._failed()
            raise
        finally:
            # (A forward that raised inside a unit left its views swapped in: parameters_restored
            # put the module's own parameters back; putting back what the swap replaced, the
            # call's stand-ins, would undo that.)
            self.running.clear()
            self.fingerprints.clear()
            self.open.clear()
        self._finished()
        return precision.cast_output(out)

    def _split_modules(self) -> contextlib.AbstractContextManager[None]:
        """Under tensor parallelism, the split modules' collectives around their forwards (``_tp.py``)."""
        axis = self.params.layout.tensor_axis
        if self.plan.tensor is None or axis is None:
            return contextlib.nullcontext()
        return split_modules(self.fn.module, self.plan.tensor, axis.group)

    @contextlib.contextmanager
    def _hooks(self, units: Iterable[Unit]) -> Iterator[None]:
        """For the block, each of ``units`` is gathered around its modules' forward: a pre- and a
        post-forward hook on each (a wrapper around a compiled unit's compiled call instead), and
        a forward of ours on its own module (rematerialised when asked, or a lookup of fetched rows)."""
        handles = []
        calls: list[tuple[nn.Module, Any]] = []  # (compiled module, its own compiled call), put back after
        forwards: list[tuple[nn.Module, Any]] = []  # (module, its own instance-level forward or _MISSING)
        swapped: list[tuple[nn.Module, str, Any]] = []
        hooked, self.hooked = self.hooked, True
        try:
            for unit in units:
                for target in self.targets[unit.name]:
                    # First among the module's pre-hooks: a user's (spectral_norm's) may read the parameters.
                    pre, post = self._pre_hook(unit, target, swapped), self._post_hook(unit, target, swapped)
                    compiled = self.wiring.compiled.get(id(target))
                    if compiled is not None:  # around the compiled call, where Dynamo does not look
                        calls.append((target, target.__dict__.get("_compiled_call_impl")))
                        target.__dict__["_compiled_call_impl"] = self._around(unit, target, compiled, pre, post)
                        continue
                    handles.append(target.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
                    handles.append(target.register_forward_hook(post))
                    if self.target is not None:
                        self.hooks[id(target)] = (pre, post)
                for own in self.targets[unit.name]:  # (a group's modules each)
                    if self.own_unit.get(id(own)) is unit:
                        forwards.append((own, own.__dict__.get("forward", _MISSING)))
                        own.forward = functools.partial(self._forward, unit, own, own.forward)
            yield
        finally:
            self.hooked = hooked
            for h in handles:
                h.remove()
            for target, call in calls:
                target.__dict__["_compiled_call_impl"] = call
            for target, forward in reversed(forwards):
                if forward is _MISSING:
                    del target.forward
                else:
                    target.forward = forward

    def _call_target(self, args: Any, kwargs: Any) -> Any:
        """The call a ``ModelHandle`` asked for: a submodule (its hooks gather what it reaches,
        the root unit is gathered already), or a method; a unit's own method runs between that
        unit's hooks, as its forward would (FSDP2's ``register_fsdp_forward_method``)."""
        assert self.target is not None
        path, method = self.target
        module = self.fn.module.get_submodule(path)
        if method is None:
            return module(*args, **kwargs)
        call = getattr(module, method)
        hooks = self.hooks.get(id(module))
        if hooks is None:
            return call(*args, **kwargs)
        pre, post = hooks
        cast = pre(module, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        return post(module, args, call(*args, **kwargs))

    # --- a unit's forward ---------------------------------------------------------------------------

    def _pre_hook(
        self, unit: Unit, target: nn.Module, swapped: list[tuple[nn.Module, str, Any]]
    ) -> Callable[..., tuple[Any, Any] | None]:
        key = (unit.name, id(target))
        precision = self.schedule.mixed_precision
        cast = precision.param_dtype is not None and precision.cast_forward_inputs

        @phased("pre_forward")
        def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
            # Each unit's floating inputs in its compute dtype, as FSDP2 casts at every
            # fully_shard module (an fp32 tensor reaching a bf16 unit: an fp32 buffer added
            # to an output, a ``.float()`` between units).
            cast_args = precision.cast_inputs(args, kwargs) if cast else None
            if cast_args is not None:
                args, kwargs = cast_args
            self.running.append(unit.name)
            group = self.open.get(unit.name)
            if group is not None:  # a group's module inside the group's gather: its views swapped in
                for owner, attr, name in self.slots[key]:
                    swapped.append((owner, attr, owner._parameters[attr]))
                    owner._parameters[attr] = group[1][name]  # type: ignore[assignment]
                self.live.setdefault(key, []).append((JOINED, 0))
                return cast_args
            # (inside a rematerialised region the gather is no operator of the region's: its
            # modes neither trace nor skip it, in the forward or the recomputation)
            with outside_region() as aside:
                if aside.inside and not any(unit.name in run.shards for run in self.regions):
                    raise RematError(_NOT_AN_INPUT.format(unit=unit_label(unit.name)))
                entered = self._enter_unit(unit, args, kwargs)
                if not self._recomputing:
                    self.order.append(unit.name)
                if entered is None:  # nothing gathered or swapped in
                    self.live.setdefault(key, []).append((FETCHING, 0))
                    return cast_args
                use, views = entered
                if self.regions:  # what the unit computes from them, the region's outputs computed from its shard
                    aside.derive(list(views.values()), self._shard_for(unit))
                for owner, attr, name in self.slots[key]:
                    swapped.append((owner, attr, owner._parameters[attr]))
                    owner._parameters[attr] = views[name]  # type: ignore[assignment]
                nodes_before = torch._C._autograd._get_sequence_nr()
                self.live.setdefault(key, []).append((use, nodes_before))
                if unit.members:
                    self.open[unit.name] = [use, views, nodes_before, None]
                if self.check_unchanged:
                    self.fingerprints.setdefault(key if not unit.members else (unit.name, -1), []).append(
                        (_fingerprints(views), views)
                    )
                self._entered(unit, use, args, kwargs)
            return cast_args

        return hook

    def _post_hook(
        self, unit: Unit, target: nn.Module, swapped: list[tuple[nn.Module, str, Any]]
    ) -> Callable[..., Any]:
        key = (unit.name, id(target))

        @phased("post_forward")
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            use, nodes_before = self.live[key].pop()
            if use is FETCHING:  # nothing was gathered or swapped
                self.running.pop()
                return output
            for _ in self.slots[key]:
                owner, attr, original = swapped.pop()
                owner._parameters[attr] = original
            self.running.pop()
            if unit.members:
                group = self.open[unit.name]
                group[3] = output
                if target is self.targets[unit.name][-1]:  # the group's last module: its gather ends
                    with outside_region():
                        return self._close_group(unit)
                return output
            with outside_region():
                if self.check_unchanged:
                    _check_unchanged(unit.name, *self.fingerprints[key].pop())
                return self._leave_unit(unit, use, output, nodes_before)

        return hook

    def _close_group(self, unit: Unit) -> Any:
        """A group's gather ends (its last module has run, or the forward did): what its
        modules' forwards made is its forward's, its last output refills it for backward."""
        use, _, nodes_before, output = self.open.pop(unit.name)
        if self.check_unchanged:
            _check_unchanged(unit.name, *self.fingerprints[(unit.name, -1)].pop())
        return self._leave_unit(unit, use, output, nodes_before)

    def _close_groups(self) -> None:
        """The forward is over: the groups whose last module did not run end here."""
        for name in list(self.open):
            self._close_group(self.plan.unit(name))

    # --- compiled units -----------------------------------------------------------------------------

    def _around(
        self,
        unit: Unit,
        target: nn.Module,
        compiled: Callable[..., Any],
        pre: Callable[..., tuple[Any, Any] | None],
        post: Callable[..., Any],
    ) -> Callable[..., Any]:
        """A compiled unit's call for this run: the pre- and post-forward hooks' work around the
        compiled code (which holds the module's own hooks and forward), rematerialised when asked."""

        def call(*args: Any, **kwargs: Any) -> Any:
            cast = pre(target, args, kwargs)
            if cast is not None:
                args, kwargs = cast
            with warnings.catch_warnings():
                # Dynamo reads ``.grad`` of the unit's parameters, which are views (non-leaf) here.
                warnings.filterwarnings("ignore", message=_NOT_A_LEAF)
                out = self._run_compiled(unit, target, compiled, args, kwargs)
            return post(target, args, out)

        return call

    def _run_compiled(
        self, unit: Unit, target: nn.Module, compiled: Callable[..., Any], args: Any, kwargs: dict[str, Any]
    ) -> Any:
        if unit.name not in self.remat_units:
            return compiled(*args, **kwargs)
        assert self.remat is not None
        if self._checkpoints(target):
            # torch's own checkpoint around the compiled code: the compiled forward's saved
            # tensors are dropped and recomputed by running it again in backward (fsdp_fn's
            # remat traces operators in a dispatch mode, which Dynamo would not compile). The
            # recomputation runs with the parameters the forward ran with (by then the module
            # holds its own again), so it recomputes exactly what the forward saved.
            state, slots = _state_slots([target])

            def region(*args: Any, **kwargs: Any) -> Any:
                with _installed(slots, state), warnings.catch_warnings():  # (recomputed in backward too)
                    warnings.filterwarnings("ignore", message=_NOT_A_LEAF)
                    return compiled(*args, **kwargs)

            return _checkpointed(region, _saving(self.remat.policy), *args, **kwargs)
        # (torch.func transforms refuse the saved-tensor hooks torch's checkpoint runs on)
        return _remat_with_state(compiled, [target], self.remat.policy, unit.name)(*args, **kwargs)

    def _checkpoints(self, target: nn.Module) -> bool:
        """Whether a compiled unit is rematerialised by torch's checkpoint: under plain autograd
        (torch.func refuses its saved-tensor hooks) and without buffers (its recomputation would
        update a BatchNorm's statistics a second time)."""
        return (
            torch.is_grad_enabled()
            and not torch._C._are_functorch_transforms_active()
            and not any(True for _ in target.buffers())
        )


def _within(
    context: Callable[[], contextlib.AbstractContextManager[None]], fn: Callable[..., Any]
) -> Callable[..., Any]:
    """``fn``, run inside a fresh ``context()`` each call."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    return call


def _lift(buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers as tensors of the current torch.func level, so the forward may update them in
    place (BatchNorm statistics); a transform refuses in-place writes to captured tensors.
    The write still lands in the buffer itself."""
    level = torch._C._functorch.maybe_current_level()
    if level is None:
        return dict(buffers)
    # (buffers made inside the transform, or differentiated by it, are of its level already)
    return {
        k: v if torch._C._functorch.maybe_get_level(v) >= level else torch._C._functorch._wrap_for_grad(v, level)
        for k, v in buffers.items()
    }


_NOT_AN_INPUT = (
    "unit {unit} runs inside a rematerialised region (a torch.utils.checkpoint of a function, ff.remat, or a "
    "rematerialised unit) that does not hold it: it lies in none of the modules the region's function reaches (the "
    "function itself, a bound method's owner, a partial's arguments, its closure's cells), so the recomputation "
    "in backward could not gather it and its gradient would be lost; reach that module through one of those (for "
    "ff.remat, make the module the region: ff.remat(module))"
)

_NOT_A_LEAF = "The .grad attribute of a Tensor that is not a leaf"  # (torch's warning, which Dynamo triggers)

# torch's own non-reentrant checkpoint, taken before a call routes torch.utils.checkpoint to fsdp_fn's remat.
_checkpoint_generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator


def _checkpointed(fn: Callable[..., Any], context_fn: Callable[[], Any], /, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)``,
    also while a call routes ``checkpoint`` to fsdp_fn's remat (which would refuse ``context_fn``)."""
    steps = _checkpoint_generator(fn, True, context_fn, "default", False, True, *args, **kwargs)
    next(steps)  # before the forward: the saved-tensor hooks that drop what the forward keeps
    out = fn(*args, **kwargs)
    with contextlib.suppress(StopIteration):
        next(steps)
    return out


def _saving(policy: SavePolicy) -> Callable[[], Any]:
    """torch's selective checkpoint contexts saving what ``policy`` saves (none: recompute everything)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

    if not policy.ops:
        return noop_context_fn

    def choose(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if policy.saves(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, choose)


def indices_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The indices an ``nn.Embedding`` is called with: ``emb(idx)`` or ``emb(input=idx)``."""
    return args[0] if args else kwargs.get("input")


_LOST = (
    "a unit's parameters are a gathered copy, freed after its forward, so the change would be lost (the shards "
    "keep the old values): change the parameters on the shards after the step, or compute the changed weight out "
    "of place in the forward"
)


def _fingerprints(views: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each parameter's bytes summed as 8-byte words (the few unaligned ones apart): any change
    to a value changes it, but for collisions. One read of the parameters, ~0.2 ms per 16 MiB,
    and one read back of the sums for the whole unit."""
    sums = []
    for view in views.values():
        raw = plain(view).detach().reshape(-1).view(torch.uint8)
        head = min(-raw.storage_offset() % 8, raw.numel())
        words = (raw.numel() - head) // 8
        # (an empty slice may sit off the 8-byte grid, where a view as int64 is refused)
        aligned = (
            raw[head : head + 8 * words].view(torch.int64).sum() if words else raw.new_zeros((), dtype=torch.int64)
        )
        ends = raw[:head].sum(dtype=torch.int64) + raw[head + 8 * words :].sum(dtype=torch.int64)
        sums.append(torch.stack([aligned, ends]))
    values = torch.stack(sums).tolist() if sums else []
    return {name: aligned * 257 + ends for name, (aligned, ends) in zip(views, values, strict=True)}


def _check_unchanged(unit: str, before: Mapping[str, int], views: Mapping[str, torch.Tensor]) -> None:
    if not before:
        return
    after = _fingerprints(views)
    changed = [name for name in before if after[name] != before[name]]
    if changed:
        raise RuntimeError(
            f"the forward of unit {unit_label(unit)} changed parameter {changed[0]!r} in place (through .data, "
            f"or a copy_/clamp_ under no_grad); {_LOST}"
        )


class ModelHandle:
    """What ``loss_fn`` gets as ``model``: ``model(x)`` runs the module on the shards;
    ``model.head(h)`` runs one of its submodules and ``model.encode(x)`` (or
    ``model.vit.forward_features(x)``) one of its methods the same way: every unit the call
    reaches is gathered just before it runs, and the gradients are those of the same
    computation on the unsharded module. Plain attributes (``model.config``) read through.
    Memory and communication: the call's units, as ``model(x)``.
    """

    __slots__ = ("_module", "_path", "_run")

    def __init__(self, run: Callable[..., Any], module: nn.Module, path: str = "") -> None:
        self._run, self._module, self._path = run, module, path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run((self._path, None) if self._path else None, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        target = self._module.get_submodule(self._path)
        path = f"{self._path}.{name}" if self._path else name
        if name in target._modules and target._modules[name] is not None:
            return ModelHandle(self._run, self._module, path)
        if name in target._parameters or name in target._buffers:
            raise AttributeError(
                f"the model's {path!r} is one of its tensors: the loss reaches the model through calls "
                "(model(x), model.head(h)), which gather the units they use; a tensor read outside them "
                "would be a stand-in"
            )
        value = getattr(target, name)
        if callable(value) and getattr(value, "__self__", None) is target:  # a method of the module
            return functools.partial(self._run, (self._path, name))
        return value


def model_handle(runtime: Runtime, run: Callable[..., Any]) -> ModelHandle:
    """The ``model`` a loss gets: ``run`` (the runtime's ``run_on`` or ``run``, its shards bound)
    on the module, or on the submodule or method a ``ModelHandle`` names."""

    def call(target: tuple[str, str | None] | None, *args: Any, **kwargs: Any) -> Any:
        runtime.target = target
        try:
            return run(*args, **kwargs)
        finally:
            runtime.target = None
            runtime.hooks.clear()

    return ModelHandle(call, runtime.fn.module)
