"""The train step's own pass: each use of a unit through its lifecycle, prefetched, its gradient sunk.

``LeanRuntime`` is a ``Runtime`` (``_runtime.py``) whose units' forwards gather a
``GatheredUnit`` each (``_unit.py``: unshard, wait for it, reshard after the forward, refill
before the backward, hand the full gradient on), prefetched along ``_prefetch.py``'s policy
within the in-flight limit; whose lookups fetch the rows they read (``_lookup.py``); and
whose gradients go to a ``GradSink`` (``_sink.py``). It is the owner of its uses (the
``Owner`` protocol of ``_unit.py``): the callbacks at each use's backward. When the loss is
known, ``finish_forward`` walks autograd's graph from it to find the uses its backward
reaches; ``finalize_backward`` settles what is left in flight when the backward is over.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_fn._frozen import InputsWatch, needing_grad
from fsdp_fn._function import plain
from fsdp_fn._functional import Functional
from fsdp_fn._lookup import RowFetch, check_indices, row_lookup
from fsdp_fn._phases import phased
from fsdp_fn._plan import Unit
from fsdp_fn._policy import BackwardPrefetch, Schedule
from fsdp_fn._prefetch import ForwardOrder, may_start, refill_next
from fsdp_fn._remat import Remat
from fsdp_fn._runtime import Phase, Runtime, indices_of
from fsdp_fn._shard import Sharded, check_shard, shards_of
from fsdp_fn._sink import GradSink
from fsdp_fn._unit import FlatPart, ForwardSpans, GatheredUnit, UnitState, gather_unit


class LeanRuntime(Runtime):
    """The train step's pass over shards: gathered buffers are freed after forward and refilled
    before backward, gathers are prefetched, gradients go to ``sink``."""

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        *,
        schedule: Schedule | None = None,
        order_hint: Sequence[str] = (),
        sink: GradSink | None = None,
        remat: Remat | None = None,
        check_unchanged: bool = False,
        compile: Mapping[str, Any] | None = None,
    ) -> None:
        sink = sink if sink is not None else GradSink(params, schedule or Schedule())
        super().__init__(
            fn,
            params,
            schedule=schedule,
            remat=remat,
            check_unchanged=check_unchanged,
            compile=compile,
            deferred=sink.deferred is not None,
        )
        self.sink = sink
        # Every use that may get a backward, in forward order: gathered, or a lookup's fetched rows.
        self.records: list[GatheredUnit | RowFetch] = []
        self.prefetched: dict[str, GatheredUnit] = {}
        # Uses that started the refill of the use after them (weak: a use gone frees its place).
        self.prefetched_after: weakref.WeakSet[GatheredUnit | RowFetch] = weakref.WeakSet()
        self.inflight = 0  # bytes of non-root unit buffers allocated now
        self.unit_bytes, self.inflight_limit = self.wiring.unit_bytes, self.wiring.inflight_limit
        # Forward prefetch follows the last step's order; its last units stay gathered for backward.
        self.forward_order = ForwardOrder(order_hint, self.unit_bytes, self.schedule)
        self.adds_during_backward = sink.deferred is not None  # full gradients summed over micro-batches
        self.watches: dict[GatheredUnit, InputsWatch] = {}  # frozen uses whose forward is running
        self.recomputed: list[GatheredUnit] = []  # uses a region's recomputation gathered, kept until their backward
        self._first_record = 0

    # --- the call ------------------------------------------------------------------------------------

    def run_on(self, params: Sharded, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:
        self._first_record = len(self.records)
        return super().run_on(params, buffers, *args, **kwargs)

    def _starting(self) -> None:
        if self.schedule.forward_prefetch:
            self._prefetch([self.forward_order.first] if self.forward_order.first else [])

    def _failed(self) -> None:
        for rec in self.prefetched.values():
            rec.release()
        self.watches.clear()

    def _finished(self) -> None:
        self.watches.clear()
        for rec in self.prefetched.values():  # prefetched along the hint, but not run this time
            rec.release()
            self.records.remove(rec)
        self.prefetched.clear()
        if not torch.is_grad_enabled():  # an evaluation call: nothing of it will get a backward
            for use in self.records[self._first_record :]:
                use.release()
            del self.records[self._first_record :]

    # --- a unit's forward ---------------------------------------------------------------------------

    def _enter_unit(self, unit: Unit, args: Any, kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]] | None:
        if self._fetches_rows(unit):  # nothing to gather: its forward fetches the rows it reads
            self.uses[unit.name] = self.uses.get(unit.name, 0) + 1
            # The rows count against the prefetch limit while they live (at most one per index).
            self.inflight += self._rows_bytes(unit, indices_of(args, kwargs))
            if self.schedule.forward_prefetch:
                self._prefetch(self.forward_order.advance(unit.name))
            return None
        if unit.name in self.lookups.plain:  # (a bad index names the unit, as a fetch does)
            check_indices(indices_of(args, kwargs), unit, in_range=True)
        if self._recomputing:  # in backward: gathered for the recomputation, nothing prefetched
            return self._gather(unit)
        upcoming = self.forward_order.advance(unit.name)
        # The units after it are issued before this one's gather is waited for, when its own
        # buffer is counted already (prefetched); else after it, so they never pass the limit.
        early = self.schedule.forward_prefetch and unit.name in self.prefetched
        if early:
            self._prefetch(upcoming)
        gathered = self._gather(unit)
        if self.schedule.forward_prefetch and not early:
            self._prefetch(upcoming)
        return gathered

    def _entered(self, unit: Unit, use: Any, args: Any, kwargs: Any) -> None:
        if use is not None and self._watches_inputs(unit):
            watch = InputsWatch.of((args, kwargs), functools.partial(self._frozen_backward_done, use))
            if watch is not None:
                self.watches[use] = watch

    def _leave_unit(self, unit: Unit, use: Any, output: Any, nodes_before: int) -> Any:
        outputs = needing_grad(output)
        watch = self.watches.pop(use, None)
        if watch is not None:
            watch.keep_if_closed(outputs)
        # A forward that recorded autograd history but returns no tensor that needs a gradient
        # (inside an object of its own, not a pytree or dataclass) leaves nothing to hook the
        # refill on: the unit stays gathered for its backward instead.
        use.made = range(nodes_before, torch._C._autograd._get_sequence_nr())
        if self.regions:
            if not self.regions[-1].again:  # a region's forward runs without autograd: no backward reads this use
                use.release()
                self.records.remove(use)
            else:  # the recomputation's: gathered until its backward, which comes next
                self.recomputed.append(use)
            return output
        hidden = not outputs and torch.is_grad_enabled() and bool(use.made)
        reshard = not hidden and not self.forward_order.keep_gathered(unit.name, self.schedule)
        if reshard:
            use.reshard()
            use.refill = self.lookups.backward_reads(unit.name, self.forced)
            if outputs and use.refill:
                use.refill_on_backward(outputs)
        return output

    # --- lookups of fetched rows ---------------------------------------------------------------------

    def _lookup(self, unit: Unit, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``nn.Embedding.forward`` on the rows its indices name, fetched from their holders."""
        indices = indices_of(args, kwargs)
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
        group, gather_dtype = self.params.group, self.schedule.gather_dtype
        # (the shards' own dtype, not the plan's: shards cast after ``shard``, FSDP2's
        # ``model.to(torch.float64)`` after ``fully_shard``, compute in their dtype)
        parts = [
            FlatPart(part, plain(shard), group, gather_dtype(shard.dtype), self.device or shard.device)
            for part, shard in shards_of(self.params, unit)
        ]
        return GatheredUnit(unit, parts, self)

    def _gather(self, unit: Unit) -> tuple[GatheredUnit | None, dict[str, torch.Tensor]]:
        self.uses[unit.name] = self.uses.get(unit.name, 0) + 1
        rec = self.prefetched.pop(unit.name, None)
        if rec is None:
            rec = self._new_record(unit)
            self.records.append(rec)
        if self.regions and not self._recomputing:  # the forward of a region: its recomputation gathers it again
            self.regions[0].region.uses[unit.name] += 1
        full = gather_unit(self._shard_for(unit), rec)
        return rec, rec.views(full)

    def _prefetch(self, names: Sequence[str]) -> None:
        """Start gathering ``names`` (the units expected to run next), in order, while they fit the limit."""
        for name in names:
            if name in self.prefetched or name in self.lookups.fetching:  # a lookup's rows come at its call
                continue
            if not may_start(self.inflight, self.unit_bytes.get(name, 0), self.inflight_limit):
                return
            rec = self._new_record(self.plan.unit(name))
            self.records.append(rec)
            rec.unshard()
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
            upcoming.unshard()
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
        if self.phase is Phase.BACKWARD and use in self.records:
            use.release()
            self._backward_done(use)

    # --- the loss is known, the backward over -------------------------------------------------------

    @phased("graph_walk")
    def finish_forward(self, loss: torch.Tensor) -> None:
        """The loss is known: find the gathered uses its backward will reach (walking autograd's
        graph), tell the sink how many per unit, and release the others now (a no-grad call,
        an output thrown away): they will never get a backward, so backward must not refill them."""
        self.phase = Phase.BACKWARD
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
        uses: collections.Counter[str] = collections.Counter()
        for region in self.region_calls:  # the uses its recomputation makes, one per use of its forward
            if not reached.isdisjoint(region.nodes):
                uses.update(region.uses)
        entries: dict[GatheredUnit, list[Any]] = collections.defaultdict(list)
        for k, entered in spans.entries([numbers[n] for n in into], out_of):
            entries[entered].append(into[k])
        for entered, nodes in entries.items():
            outputs = [n for n in nodes if n._sequence_nr() not in entered.outputs]
            if outputs:
                entered.refill_on_entry(outputs)
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

    def finalize_backward(self) -> None:
        """The backward is over: wait for the reductions still in flight (before anything reads
        a gradient) and drop what is left gathered."""
        for use in self.recomputed:  # one the recomputation's outputs did not reach: counted, so handed on empty
            if use in self.records and use.state is UnitState.GATHERED and use.unit.params:
                use.post_backward()
        self.sink.settle()
        self.release_all()

    def release_all(self) -> None:
        """Drop what is left (units with only frozen parameters get no gradient, so nothing
        released them when their backward was done)."""
        for rec in self.records:
            rec.release()
        self.records.clear()
        self.recomputed.clear()
        self.sink.spare = None  # no flat gradient comes after backward
        self.phase = Phase.DONE

    def abandon(self) -> None:
        """After a forward or backward that raised: let this step's exchanges in flight finish
        and drop them, so none is left to meet the next step's. A wait that fails (another rank
        failed too) gives up on the rest: the error already raised is the one to report."""
        with contextlib.suppress(Exception):
            self.sink.abandon()
            self.release_all()  # the prefetched uses are records too
        self.prefetched.clear()
        self.records.clear()
        self.phase = Phase.DONE
