"""Running a module over shards: each unit gathered just before it runs.

Two ways:

* **composable** (``apply_sharded``, and ``value_and_grad`` inside another ``torch.func``
  transform): each unit is the differentiable all-gather of ``gather_for``, whose backward
  is the reduce-scatter and whose tangent and batching rules are the collective's own, so
  every transform composes. Gathered units stay alive as long as autograd holds them.
* **lean** (the train step's own pass): each use of a unit goes through the lifecycle of
  ``_unit.py`` (freed after forward, refilled before backward), gathers are prefetched
  along ``_prefetch.py``'s policy, gradients go to a ``GradSink``.

Hooks (and, for units that may be rematerialised, a forward of ours) are installed on
the units' modules for the duration of ``run`` only; the module is left as it was.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from fsdp_fn._collectives import all_gather, pairwise
from fsdp_fn._frozen import InputsWatch, needing_grad
from fsdp_fn._functional import Functional, index_of, parameters_restored, requires_grad_tolerated
from fsdp_fn._gather import gather_differentiably
from fsdp_fn._lookup import RowFetch, check_indices, row_lookup, rows_fit
from fsdp_fn._phases import phased
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Unit, unit_label
from fsdp_fn._policy import BackwardPrefetch, Schedule
from fsdp_fn._prefetch import ForwardOrder, gathered_bytes, inflight_limit, may_start, refill_next
from fsdp_fn._remat import Remat, SavePolicy, route_torch_checkpoint, save_nothing
from fsdp_fn._remat._function import _remat_with_state
from fsdp_fn._remat._routing import handling_regions
from fsdp_fn._remat._state import _installed, _state_slots
from fsdp_fn._shard import Sharded, check_shard, ensure_live, shards_of, unit_views
from fsdp_fn._sink import GradSink
from fsdp_fn._standin import StandIn
from fsdp_fn._unit import FlatPart, ForwardSpans, GatheredUnit, UnitState, gather_unit, plain


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


def _not_gathered(spec: ParamSpec, unit: str, device: torch.device) -> StandIn:
    """Stands in for a unit's parameter outside that unit's forward: what it is (shape, dtype, the
    device the unit runs on, requires_grad) can be read, as ``x.to(w.device)`` does; any use raises."""
    return StandIn(
        spec.shape,
        spec.dtype,
        device,
        f"parameter {spec.name!r} of unit {unit_label(unit)} was used outside that unit's forward ({{op}}); "
        "a unit's parameters exist only while its module runs: call the module (not .forward directly) "
        "or put this use in the same unit",
        requires_grad=spec.requires_grad,
    )


_MISSING = object()
_DEFAULT_SCHEDULE = Schedule()

Swapped = list[tuple[nn.Module, str, Any]]  # (owner, attribute, original parameter) put back after the call


_FETCHING = "fetching rows"  # the pre-hook's mark for a lookup whose forward fetches its rows


class Wiring:
    """What running a module over shards needs that is the same at every call: each unit's
    modules and where a gather puts its parameters, the units to rematerialise, the prefetch
    limit, the lookups whose rows are fetched. Made once per module, plan, schedule and group
    (``Wiring.of``), then shared by every call: a step's Runtime does none of this again."""

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        schedule: Schedule,
        remat: Remat | None,
        composable: bool,
        deferred: bool,
        compile: Mapping[str, Any] | None = None,
    ) -> None:
        _check_plan_fits(params.plan, fn)
        module, plan = fn.module, params.plan
        self.keep = (plan, schedule, remat)  # (the cache's key holds their ids)
        self.sparse_grads = _sparse_grad_params(module, plan) if composable else frozenset()
        self.modules: dict[str, nn.Module] = {u.name: module.get_submodule(u.name) for u in plan.units if not u.hooks}
        # Each unit's modules, one entry per module object (a module shared under several
        # paths is hooked once), and where a gather puts its parameters in it.
        self.targets: dict[str, list[nn.Module]] = {}
        self.slots: dict[tuple[str, int], list[tuple[nn.Module, str, str]]] = {}
        for unit in plan.units:
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
        # Units whose module is compiled (``module.compile()``, or ``compile=`` here): their call goes
        # through a wrapper of ours around the compiled code, so nothing of the gathering is traced.
        self.compiled: dict[int, Callable[..., Any]] = {}
        for unit in plan.units:
            for target in self.targets[unit.name] if unit.name != ROOT else ():
                own = target.__dict__.get("_compiled_call_impl")
                if own is not None:
                    self.compiled[id(target)] = own
                elif compile is not None:
                    self.compiled[id(target)] = torch.compile(target._call_impl, **compile)
        # Units that can be rematerialised run through a forward of ours for the call: the
        # ones ``remat`` selects, and the ones a torch.utils.checkpoint region asks for
        # (compiled ones are rematerialised around their compiled call instead).
        self.own_unit: dict[int, Unit] = {
            id(self.modules[u.name]): u
            for u in plan.units
            if u.name != ROOT and not u.hooks and id(self.modules[u.name]) not in self.compiled
        }
        self.remat_units = remat.selects(plan, module) if remat is not None else frozenset()
        for name in self.remat_units:
            check_rematerialisable(fn, plan, plan.unit(name), "train_step(remat=...)")
        # Each non-root unit's gathered bytes; prefetching may hold max_inflight times the largest.
        self.unit_bytes = gathered_bytes(plan, params.group.size(), schedule)
        self.inflight_limit = inflight_limit(self.unit_bytes, schedule)
        self.lookups = frozenset(u.name for u in plan.units if u.lookup)
        # Outside its forward each non-root unit's parameter is a stand-in that raises if read.
        offload = schedule.cpu_offload
        self.standins = {
            p.name: _not_gathered(p, u.name, offload.compute_device() if offload else params[u.name].device)
            for u in plan.units
            if u.name != ROOT
            for p in u.all_params
        }
        # Where each tensor of a call goes, what ``functional_call`` would work out at every call:
        # (owner, attribute, the tensor's name, a parameter?) for every name of every parameter the
        # plan knows (tied aliases included) and of every buffer (tied ones by their first name).
        index = index_of(module)
        canonical = {name: spec.name for spec in plan.params for name in (spec.name, *spec.aliases)}
        self.swaps: list[tuple[nn.Module, str, str, bool]] = [
            (holder, attr, canonical[name], True) for name, holder, attr in index.param_slots if name in canonical
        ]
        first: dict[int, str] = {}
        for name, holder, attr in index.buffer_slots:
            buffer = holder._buffers[attr]
            if buffer is not None:
                self.swaps.append((holder, attr, first.setdefault(id(buffer), name), False))
        # Lookups whose rows are fetched instead of their table gathered (``_lookup.py``): over
        # gloo's pairwise sends, on CPU, in the shard's own dtype and place, reduced per
        # micro-batch, without replicas, not rematerialised, and not renormalising rows or
        # making sparse gradients (and without a hook of the user's: the call checks that).
        self.row_lookups = frozenset(
            name
            for name in self.lookups
            if not composable
            and params.group.size() > 1
            and pairwise(params.group)
            and rows_fit(plan.unit(name), schedule, params.layout.replicas, params.group.size())
            and params[name].device.type == "cpu"  # not yet measured on accelerators
            and not deferred
            and name not in self.remat_units
            and self.modules[name].max_norm is None
            and not self.modules[name].sparse
            and id(self.modules[name]) not in self.compiled
        )

    @staticmethod
    def of(
        fn: Functional,
        params: Sharded,
        schedule: Schedule,
        remat: Remat | None,
        composable: bool,
        deferred: bool,
        compile: Mapping[str, Any] | None = None,
    ) -> Wiring:
        """The wiring for this call, made at the first call like it and kept with ``fn``."""
        group = params.group
        shard = next(iter(params.shards.values()), None)
        key = (
            id(params.plan),
            id(schedule),
            id(remat),
            composable,
            deferred,
            group.group_name,
            pairwise(group),
            params.layout.replicas,
            shard.device.type if shard is not None else "",
            None if compile is None else tuple(sorted(compile.items())),
        )
        known = _wirings.setdefault(fn, {})
        wiring = known.get(key)
        if wiring is None:
            if len(known) >= 8:  # a caller that builds a new schedule at every call: keep the newest only
                del known[next(iter(known))]
            wiring = known[key] = Wiring(fn, params, schedule, remat, composable, deferred, compile)
        return wiring


_wirings: weakref.WeakKeyDictionary[Functional, dict[tuple[Any, ...], Wiring]] = weakref.WeakKeyDictionary()


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
        check_unchanged: bool = False,
        compile: Mapping[str, Any] | None = None,
    ) -> None:
        ensure_live(params, "apply_sharded")
        self.fn, self.params = fn, params
        # Whether each unit's forward is checked for changing its gathered parameters in place
        # (a fingerprint of them before and after: one read of the unit more, no communication).
        self.check_unchanged = check_unchanged
        self.fingerprints: dict[tuple[str, int], list[tuple[dict[str, int], dict[str, torch.Tensor]]]] = {}
        self.schedule = schedule or _DEFAULT_SCHEDULE
        self.composable = composable
        self.sink = sink if sink is not None else GradSink(params, self.schedule)
        deferred = self.sink.deferred is not None
        self.wiring = wiring = Wiring.of(fn, params, self.schedule, remat, composable, deferred, compile)
        offload = self.schedule.cpu_offload
        self.device = offload.compute_device() if offload is not None else None
        self.plan = params.plan
        self.uses: dict[str, int] = {}  # gathered uses per unit in this forward
        # Every use that may get a backward, in forward order: gathered, or a lookup's fetched rows.
        self.records: list[GatheredUnit | RowFetch] = []
        self.prefetched: dict[str, GatheredUnit] = {}
        # Uses that started the refill of the use after them (weak: a use gone frees its place).
        self.prefetched_after: weakref.WeakSet[GatheredUnit | RowFetch] = weakref.WeakSet()
        self.inflight = 0  # bytes of non-root unit buffers allocated now
        self.unit_bytes, self.inflight_limit = wiring.unit_bytes, wiring.inflight_limit
        # Forward prefetch follows the last step's order; its last units stay gathered for backward.
        self.forward_order = ForwardOrder(order_hint, self.unit_bytes, self.schedule)
        self.adds_during_backward = self.sink.deferred is not None  # full gradients summed over micro-batches
        self.running: list[str] = []  # units whose forward is in progress, innermost last
        self.order: list[str] = []  # units in the order their forward ran
        # Uses whose forward is running: the gathered use, None (composable), or _FETCHING (a lookup's rows).
        # (unit, module) -> its uses running now: the record, and autograd's node count at its start
        self.live: dict[tuple[str, int], list[tuple[GatheredUnit | str | None, int]]] = {}
        self.watches: dict[GatheredUnit, InputsWatch] = {}  # frozen uses whose forward is running
        self.loss_known = False  # finish_forward ran: a backward from now on is the step's own
        self.sparse_grads = wiring.sparse_grads
        self.targets, self.slots, self.own_unit = wiring.targets, wiring.slots, wiring.own_unit
        self.modules = wiring.modules
        self.remat = remat
        self.remat_units = wiring.remat_units
        self.forced: set[str] = set()  # units a routed torch checkpoint region rematerialises now
        # Lookup units (a plain nn.Embedding) whose module carries no hook of the user's: their
        # backward reads no parameter, so their buffer is not gathered again for it.
        global_hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
        self.lookups = {
            name
            for name in wiring.lookups
            if not global_hooks and not (self.modules[name]._forward_hooks or self.modules[name]._forward_pre_hooks)
        }
        self.row_lookups = wiring.row_lookups & self.lookups

    # --- rematerialisation -------------------------------------------------------------------------

    def _forward(self, unit: Unit, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The unit's forward for this call: rematerialised when asked, a lookup of fetched rows,
        otherwise the module's own."""
        if self._fetches_rows(unit):
            return self._lookup(unit, *args, **kwargs)
        if unit.name in self.forced:
            return _remat_with_state(original, [self.modules[unit.name]], save_nothing, unit.name)(*args, **kwargs)
        if unit.name in self.remat_units:
            assert self.remat is not None
            module = self.modules[unit.name]
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
            check_rematerialisable(
                self.fn, self.plan, unit, f"torch.utils.checkpoint.checkpoint of unit {unit_label(unit.name)}"
            )
        added = [u.name for u in units if u.name not in self.forced]
        self.forced.update(added)
        try:
            return function(*args, **kwargs)
        finally:
            self.forced.difference_update(added)

    # --- lookups of fetched rows ---------------------------------------------------------------------

    def _fetches_rows(self, unit: Unit) -> bool:
        """Whether this call of ``unit`` fetches its rows (not under a transform, which may rewrite
        the lookup, nor inside a checkpoint region, which runs it again in backward)."""
        return (
            unit.name in self.row_lookups
            and unit.name not in self.forced
            and torch._C._functorch.maybe_current_level() is None
        )

    def _lookup(self, unit: Unit, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``nn.Embedding.forward`` on the rows its indices name, fetched from their holders."""
        indices = _indices(args, kwargs)
        check_indices(indices, unit)
        module = self.modules[unit.name]
        assert isinstance(module, nn.Embedding)
        shard = check_shard(self.params, unit)
        fetch = RowFetch(unit, plain(shard), self.params.group, self)
        rows, inverse, distinct = fetch.fetch(indices)
        if torch.is_grad_enabled():
            self.records.append(fetch)
        table = row_lookup(shard, fetch, rows)
        padding = None
        if module.padding_idx is not None:
            at = int(torch.searchsorted(distinct, module.padding_idx))
            padding = at if at < distinct.numel() and int(distinct[at]) == module.padding_idx else None
        out = torch.nn.functional.embedding(
            inverse, table, padding, None, module.norm_type, module.scale_grad_by_freq, False
        )
        self.inflight -= self._rows_bytes(unit, indices)  # F.embedding keeps no row for backward
        return out

    def _rows_bytes(self, unit: Unit, indices: Any) -> int:
        """The most bytes a lookup's rows take: one row per index, the table at most."""
        count = indices.numel() if isinstance(indices, torch.Tensor) else 0
        rows, dim = unit.params[0].shape
        return min(count, rows) * dim * unit.dtype.itemsize

    def after_row_backward(self, fetch: RowFetch, finish: Callable[[], torch.Tensor]) -> None:
        """A lookup's backward has run: its rows' gradient is on its way to their holders."""
        self._backward_done(fetch)
        self.sink.push_reduced(fetch.unit, finish, (True,))

    # --- gathering ---------------------------------------------------------------------------------

    def _new_record(self, unit: Unit) -> GatheredUnit:
        check_shard(self.params, unit)
        group, gather_dtype = self.params.group, self.schedule.gather_dtype
        parts = [
            FlatPart(part, plain(shard), group, gather_dtype(part.dtype), self.device or shard.device)
            for part, shard in shards_of(self.params, unit)
        ]
        return GatheredUnit(unit, parts, self)

    def _gather(self, unit: Unit) -> tuple[GatheredUnit | None, dict[str, torch.Tensor]]:
        self.uses[unit.name] = self.uses.get(unit.name, 0) + 1
        if self.composable:
            return None, self._gather_composable(unit)
        rec = self.prefetched.pop(unit.name, None)
        if rec is None:
            rec = self._new_record(unit)
            self.records.append(rec)
        full = gather_unit(check_shard(self.params, unit), rec)
        return rec, rec.views(full)

    def _gather_composable(self, unit: Unit) -> dict[str, torch.Tensor]:
        layout = self.params.layout
        out: dict[str, torch.Tensor] = {}
        for part, shard in shards_of(self.params, unit):
            source = shard.to(dtype=self.schedule.gather_dtype(part.dtype), device=self.device or shard.device)
            if part is unit:
                full = gather_differentiably(source, layout, unit.name)
            else:  # frozen: a constant
                with torch.no_grad():
                    full = all_gather(source.detach(), layout.group, unit=unit.name)
            views = unit_views(part, full)
            if part is unit and torch.is_grad_enabled() and torch._C._functorch.maybe_current_level() is None:
                for name in self.sparse_grads & views.keys():
                    views[name] = _DenseGrad.apply(views[name])
            out.update(views)
        return out

    def _prefetch(self, names: Sequence[str]) -> None:
        """Start gathering ``names`` (the units expected to run next), in order, while they fit the limit."""
        if self.composable:
            return
        for name in names:
            if name in self.prefetched or name in self.row_lookups:  # a lookup's rows come at its call
                continue
            if not may_start(self.inflight, self.unit_bytes.get(name, 0), self.inflight_limit):
                return
            rec = self._new_record(self.plan.unit(name))
            self.records.append(rec)
            rec.start()
            self.prefetched[name] = rec

    def _prefetch_backward(self, rec: GatheredUnit | RowFetch) -> None:
        """Start refilling the use whose backward comes next (the previous one in forward order),
        once per use.

        One use ahead only: backward starts where memory peaks (the loss's gradient, the
        head's), and a second block refilled there raised the peak (6 MiB at W=4)."""
        if rec in self.prefetched_after:
            return
        upcoming = refill_next(self.records, rec)
        if upcoming is not None and may_start(self.inflight, upcoming.nbytes, self.inflight_limit):
            upcoming.start()
            self.prefetched_after.add(rec)

    # --- the Owner of gathered uses (_unit.py) ---------------------------------------------------

    def before_backward(self, use: GatheredUnit) -> None:
        # A use that gets no gradient, or holds its gradients until its backward ends (the root,
        # a shared unit), reaches before_grad late or never: it refills the next use now.
        if self.schedule.backward_prefetch is BackwardPrefetch.BACKWARD_PRE and not (
            use.unit.params and use.write_at_once
        ):
            self._prefetch_backward(use)

    def before_grad(self, use: GatheredUnit) -> None:
        # The reduction left in flight behind this backward ends here, before the new flat
        # gradient exists: the previous unit's full gradient and this one's never live at once.
        self.sink.drain()
        # BACKWARD_PRE refills the next use now, not when this backward starts: the reduction's
        # buffers (its full gradient, the received shards) are gone, so they never meet the
        # refilled unit at the top of this backward, where memory peaks; and a unit kept
        # gathered after forward (which is not refilled) starts the prefetch too.
        if self.schedule.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward(use)

    def spare_grad(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return self.sink.take_spare(numel, dtype, device)

    def after_backward(self, use: GatheredUnit, full: torch.Tensor) -> None:
        self._backward_done(use)
        self.sink.push(use.unit, full, use.received, reusable=not use.taken)

    def _backward_done(self, use: GatheredUnit | RowFetch) -> None:
        if self.schedule.backward_prefetch is not None:  # BACKWARD_PRE: if no gradient came first
            self._prefetch_backward(use)
        if use in self.records:
            self.records.remove(use)  # done: backward prefetch looks only at uses still to come

    def _watches_inputs(self, unit: Unit) -> bool:
        """Whether this use ends its backward when its inputs' gradients are in (``_frozen.py``):
        a unit of frozen parameters alone, run by its own module (not a shared one's hooks),
        under no transform, in a call that will get a backward."""
        return (
            not unit.params
            and not unit.hooks
            and torch.is_grad_enabled()
            and torch._C._functorch.maybe_current_level() is None
        )

    def _frozen_backward_done(self, use: GatheredUnit) -> None:
        """A frozen use's backward has run (its inputs' gradients are in): drop its buffer now,
        not when the whole backward ends, so the refills after it fit."""
        # (A backward inside loss_fn, before the loss is known, is not the last to read the buffer.)
        if self.loss_known and use in self.records:
            use.release()
            self._backward_done(use)

    def _backward_reads(self, unit: Unit) -> bool:
        """Whether this use's backward may read its gathered parameters: not for a lookup unit
        run plainly (not rematerialised: it would run again in backward; a region around
        other modules cannot hold a unit; under no transform, which may rewrite the lookup)."""
        return not (
            unit.name in self.lookups
            and unit.name not in self.remat_units
            and unit.name not in self.forced
            and torch._C._functorch.maybe_current_level() is None
        )

    def _after_forward(self, rec: GatheredUnit, outputs: list[torch.Tensor], reshard: bool, refill: bool) -> None:
        """``outputs``: those of the use's forward that need a gradient."""
        if not reshard:
            return
        rec.free()
        rec.refill = refill
        if outputs and refill:
            rec.refill_on_backward(outputs)

    @phased("graph_walk")
    def finish_forward(self, loss: torch.Tensor) -> None:
        """The loss is known: find the gathered uses its backward will reach (walking autograd's
        graph), tell the sink how many per unit, and release the others now (a no-grad call,
        an output thrown away): they will never get a backward, so backward must not refill them."""
        self.loss_known = True
        # A freed use's refill hooks its outputs; a path into its forward that bypasses them (a
        # tensor it kept on its module, read by the loss) would reach a node reading the freed
        # buffer first: the nodes where such paths enter refill it too.
        spans = ForwardSpans(
            [r for r in self.records if isinstance(r, GatheredUnit) and r.state is UnitState.FREED and r.refill]
        )
        numbers: dict[Any, int] = {}  # each node the loss's backward reaches -> its sequence number
        into: list[Any] = []  # edges to a node not seen yet (a way into it): its node and the source's number
        out_of: list[int] = []
        track = bool(spans.uses)
        # Uses whose gather's node the walk meets: known by number (``use.node``) or, for a gather
        # applied under a torch.func transform inside the loss, by the node's own reference.
        gathers: set[int] = set()
        python_node = torch.autograd.function.BackwardCFunction
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in numbers:
                continue
            if isinstance(node, python_node):
                use = getattr(node, "fsdp_fn_use", None)
                if use is not None:
                    gathers.add(id(use))
            number = numbers[node] = node._sequence_nr()
            for next_node, _ in node.next_functions:
                if next_node is not None and next_node not in numbers:
                    stack.append(next_node)
                    if track:
                        into.append(next_node)
                        out_of.append(number)
        reached = set(numbers.values())  # (see GatheredUnit.outputs)
        entries: dict[GatheredUnit, list[Any]] = collections.defaultdict(list)
        for k, entered in spans.entries([numbers[n] for n in into], out_of):
            entries[entered].append(into[k])
        for entered, nodes in entries.items():
            outputs = [n for n in nodes if n._sequence_nr() not in entered.outputs]
            if outputs:
                entered.refill_on_entry(outputs)
        uses: collections.Counter[str] = collections.Counter()
        for rec in list(self.records):
            if rec.node in reached or id(rec) in gathers:
                uses[rec.unit.name] += 1
                continue
            # Refilled by outputs the backward reaches: the backward reads its parameters.
            refilled = isinstance(rec, GatheredUnit) and not rec.outputs.isdisjoint(reached)
            # (a gathered frozen part may be read by the backward through its own views)
            if not refilled and (rec.state is UnitState.FREED or not rec.unit.frozen):
                rec.release()
                self.records.remove(rec)
        self.sink.expect(uses)

    def release_all(self) -> None:
        """After backward: drop what is left (units with only frozen parameters get no gradient,
        so nothing released them when their backward was done)."""
        for rec in self.records:
            rec.release()
        self.records.clear()
        self.sink.spare = None  # no flat gradient comes after backward

    def abandon(self) -> None:
        """After a forward or backward that raised: let this step's exchanges in flight finish
        and drop them, so none is left to meet the next step's. A wait that fails (another rank
        failed too) gives up on the rest: the error already raised is the one to report."""
        with contextlib.suppress(Exception):
            self.sink.abandon()
            self.release_all()  # the prefetched uses are records too
        self.prefetched.clear()
        self.records.clear()

    # --- running ------------------------------------------------------------------------------------

    def run(self, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        return self.run_on(self.params, buffers, *args, **kwargs)

    def run_on(self, params: Sharded, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        """Run the module with ``params`` (the runtime's shards, possibly inside a transform)."""
        self.params = params
        module = self.fn.module
        precision = self.schedule.mixed_precision
        args, kwargs = precision.cast_inputs(args, kwargs)
        first_record = len(self.records)
        tensors: dict[str, torch.Tensor] = dict(self.wiring.standins)
        root: tuple[dict[str, int], dict[str, torch.Tensor]] = ({}, {})
        if ROOT in self.modules:
            views = self._gather(self.plan.unit(ROOT))[1]
            root = (_fingerprints(views) if self.check_unchanged else {}, views)
            tensors.update(views)
        tensors.update(_lift(buffers))
        if self.schedule.forward_prefetch:
            self._prefetch([self.forward_order.first] if self.forward_order.first else [])

        handles = []
        calls: list[tuple[nn.Module, Any]] = []  # (compiled module, its own compiled call), put back after
        swapped: list[tuple[nn.Module, str, Any]] = []
        for unit in self.plan.units:
            if unit.name == ROOT:
                continue
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
        forwards: list[tuple[nn.Module, Any]] = []  # (module, its own instance-level forward or _MISSING)
        for unit in self.own_unit.values():
            target = self.modules[unit.name]
            forwards.append((target, target.__dict__.get("forward", _MISSING)))
            target.forward = functools.partial(self._forward, unit, target.forward)
        try:
            with (
                parameters_restored(module),
                route_torch_checkpoint(),
                handling_regions(self._region),
                requires_grad_tolerated(),
            ):
                for owner, attr, name, is_param in self.wiring.swaps:  # what functional_call does, wired once
                    value = tensors.get(name)
                    if value is not None:
                        (owner._parameters if is_param else owner._buffers)[attr] = value  # type: ignore[index,assignment]
                out = module(*args, **kwargs)
            _check_unchanged(ROOT, *root)
        except Exception as e:
            where = f"unit {unit_label(self.running[-1])}" if self.running else "the root unit"
            e.add_note(f"fsdp_fn: raised in the forward of {where}")
            if "_ParamView is a view and its base" in str(e):  # autograd's words for it, under no_grad
                e.add_note(f"fsdp_fn: the forward of {where} changed one of its parameters in place; {_LOST}")
            for rec in self.prefetched.values():
                rec.release()
            raise
        finally:
            for h in handles:
                h.remove()
            for target, call in calls:
                target.__dict__["_compiled_call_impl"] = call
            for target, forward in forwards:
                if forward is _MISSING:
                    del target.forward
                else:
                    target.forward = forward
            # (A forward that raised inside a unit left its views swapped in: parameters_restored
            # put the module's own parameters back; putting back what the swap replaced, the
            # call's stand-ins, would undo that.)
            self.running.clear()
            self.watches.clear()
            self.fingerprints.clear()
        for rec in self.prefetched.values():  # prefetched along the hint, but not run this time
            rec.release()
            self.records.remove(rec)
        self.prefetched.clear()
        if not torch.is_grad_enabled():  # an evaluation call: nothing of it will get a backward
            for use in self.records[first_record:]:
                use.release()
            del self.records[first_record:]
        return precision.cast_output(out)

    def _around(
        self,
        unit: Unit,
        target: nn.Module,
        compiled: Callable[..., Any],
        pre: Callable[..., None],
        post: Callable[..., Any],
    ) -> Callable[..., Any]:
        """A compiled unit's call for this run: the pre- and post-forward hooks' work around the
        compiled code (which holds the module's own hooks and forward), rematerialised when asked."""

        def call(*args: Any, **kwargs: Any) -> Any:
            pre(target, args, kwargs)
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

    def _pre_hook(
        self, unit: Unit, target: nn.Module, swapped: list[tuple[nn.Module, str, Any]]
    ) -> Callable[..., None]:
        key = (unit.name, id(target))

        @phased("pre_forward")
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.running.append(unit.name)
            if self._fetches_rows(unit):  # nothing to gather: its forward fetches the rows it reads
                self.uses[unit.name] = self.uses.get(unit.name, 0) + 1
                # The rows count against the prefetch limit while they live (at most one per index).
                self.inflight += self._rows_bytes(unit, _indices(args, kwargs))
                if self.schedule.forward_prefetch:
                    self._prefetch(self.forward_order.advance(unit.name))
                self.order.append(unit.name)
                self.live.setdefault(key, []).append((_FETCHING, 0))
                return
            if unit.name in self.lookups and not self.composable:  # (a bad index names the unit, as a fetch does)
                check_indices(_indices(args, kwargs), unit, in_range=True)
            upcoming = self.forward_order.advance(unit.name)
            # The units after it are issued before this one's gather is waited for, when its own
            # buffer is counted already (prefetched); else after it, so they never pass the limit.
            early = self.schedule.forward_prefetch and unit.name in self.prefetched
            if early:
                self._prefetch(upcoming)
            rec, views = self._gather(unit)
            if self.schedule.forward_prefetch and not early:
                self._prefetch(upcoming)
            for owner, attr, name in self.slots[key]:
                swapped.append((owner, attr, owner._parameters[attr]))
                owner._parameters[attr] = views[name]  # type: ignore[assignment]
            self.order.append(unit.name)
            self.live.setdefault(key, []).append((rec, torch._C._autograd._get_sequence_nr()))
            if self.check_unchanged:
                self.fingerprints.setdefault(key, []).append((_fingerprints(views), views))
            if rec is not None and self._watches_inputs(unit):
                watch = InputsWatch.of((args, kwargs), functools.partial(self._frozen_backward_done, rec))
                if watch is not None:
                    self.watches[rec] = watch

        return hook

    def _post_hook(
        self, unit: Unit, target: nn.Module, swapped: list[tuple[nn.Module, str, Any]]
    ) -> Callable[..., Any]:
        key = (unit.name, id(target))

        @phased("post_forward")
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            rec, nodes_before = self.live[key].pop()
            if isinstance(rec, str):  # _FETCHING: nothing was gathered or swapped
                self.running.pop()
                return output
            for _ in self.slots[key]:
                owner, attr, original = swapped.pop()
                owner._parameters[attr] = original
            if self.check_unchanged:
                _check_unchanged(unit.name, *self.fingerprints[key].pop())
            self.running.pop()
            if rec is None:  # composable: autograd holds the gathered unit
                return output
            outputs = needing_grad(output)
            watch = self.watches.pop(rec, None)
            if watch is not None:
                watch.keep_if_closed(outputs)
            # A forward that recorded autograd history but returns no tensor that needs a gradient
            # (inside an object of its own, not a pytree or dataclass) leaves nothing to hook the
            # refill on: the unit stays gathered for its backward instead.
            rec.made = range(nodes_before, torch._C._autograd._get_sequence_nr())
            hidden = not outputs and torch.is_grad_enabled() and bool(rec.made)
            reshard = not hidden and not self.forward_order.keep_gathered(unit.name, self.schedule)
            self._after_forward(rec, outputs, reshard, self._backward_reads(unit))
            return output

        return hook


def check_rematerialisable(fn: Functional, plan: Plan, unit: Unit, asked_by: str) -> None:
    """A rematerialised unit is recomputed in backward, after this call's hooks are gone:
    every parameter it reads must be its own (another unit's would not be gathered then)."""
    module = fn.module.get_submodule(unit.name)
    own = {spec.name for spec in unit.all_params} | {a for spec in unit.all_params for a in spec.aliases}
    prefix = f"{unit.name}."
    for name, _ in module.named_parameters(remove_duplicate=False):
        full = prefix + name
        if full not in own:
            other = plan.unit_of(full).name
            raise ValueError(
                f"{asked_by}: unit {unit_label(unit.name)} cannot be rematerialised: it reads parameter "
                f"{full!r} of unit {unit_label(other)}, which is not gathered when the unit is recomputed in "
                "backward; rematerialise the units inside it instead (or put that parameter in this unit)"
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


def _indices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The indices an ``nn.Embedding`` is called with: ``emb(idx)`` or ``emb(input=idx)``."""
    return args[0] if args else kwargs.get("input")


def _sparse_grad_params(module: nn.Module, plan: Plan) -> frozenset[str]:
    """The parameters whose gradient is sparse: the weights of ``nn.Embedding(sparse=True)`` and bags."""
    names = {
        f"{path}.weight".lstrip(".")
        for path, m in module.named_modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
    }
    return frozenset(spec.name for spec in plan.params if names & {spec.name, *spec.aliases})


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes a sparse gradient dense: autograd cannot reshape a sparse
    gradient into the unit's flat one. Memory: the parameter's dense gradient, as for any other."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad if grad.layout == torch.strided else grad.to_dense()


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
