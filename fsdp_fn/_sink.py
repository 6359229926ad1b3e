"""The gradient sink: where a unit's full gradient goes once its backward has run.

Reduce (a reduce-scatter issued at once, left in flight until the next unit's first
gradient arrives), defer (accumulating micro-batches without reducing), deliver (the shards of
every use of a unit summed; a unit handed on the moment its last use is reduced) and
drain (wait for what is left at the end of backward). Replicas (hybrid sharding) average
their shards here, in ``reduce_unit``: the one place gradients cross ranks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fsdp_fn import _reached as reached
from fsdp_fn._collectives import all_reduce_over_, divides_first, reduce_scatter_start
from fsdp_fn._function import plain_mode
from fsdp_fn._labels import label
from fsdp_fn._plan import Unit
from fsdp_fn._policy import Schedule
from fsdp_fn._shard import Sharded


class GradSink:
    """Where a unit's full gradient goes when its backward has run (lean path).

    ``push`` issues the unit's reduce-scatter without waiting (the runtime ``drain``s it
    when the next unit's first gradient arrives, before that unit's flat gradient is
    allocated) and the shards of every use of a unit are summed; with
    ``defer`` (accumulating micro-batches without reducing) the full gradients are summed
    instead and reduced once by ``reduce_deferred``. ``on_unit(unit, grad, received)`` is
    called the moment a unit's last reachable use is reduced (``expect`` says how many
    uses the loss reaches), ``received`` merged over the ranks (torch's rule: a parameter some
    rank's batch reached gets a gradient) by messages issued beside that use's reduce-scatter;
    otherwise ``drain()`` then ``grads()`` hand them over at the end.
    Memory: one gradient shard per unit (or one full gradient per unit with ``defer``),
    plus the full gradient of the reduction in flight (and ``W-1`` received shards).
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
        self.pushed: collections.Counter[str] = collections.Counter()
        self.reached: dict[str, Callable[[], tuple[bool, ...]]] = {}  # on_unit: the masks being merged
        self.unsettled: list[Callable[[], Any]] = []  # merges not waited for (their result was known): by settle()
        self.pending: collections.deque[tuple[str, Callable[[], torch.Tensor], torch.Tensor | None]] = (
            collections.deque()
        )
        # The full gradient of the reduction that ended last, free now: the next unit's flat
        # gradient of the same size is written into it (no fresh allocation to fault in).
        self.spare: torch.Tensor | None = None
        self.delivered: list[str] = []  # units handed to on_unit, in order

    def expect(self, uses: Mapping[str, int]) -> None:
        """How many gathered uses of each unit the loss reaches (the others never get a backward)."""
        self.expected = dict(uses)

    def _mark(self, unit: Unit, received: Sequence[bool], device: torch.device) -> None:
        mask = self.received.setdefault(unit.name, [False] * len(unit.params))
        for i, got in enumerate(received):
            mask[i] = mask[i] or got
        self.pushed[unit.name] += 1
        if self.on_unit is not None and self.pushed[unit.name] == self.expected.get(unit.name, 0):
            self.reached[unit.name] = reached.merge_start(
                self.params.layout, unit.name, tuple(mask), device, self.unsettled
            )

    def push_reduced(self, unit: Unit, finish: Callable[[], torch.Tensor], received: Sequence[bool]) -> None:
        """A reduction already issued (a lookup's rows' gradient on its way): ``finish()`` waits
        and gives the gradient shard; left in flight like a reduce-scatter."""
        self._mark(unit, received, self.params[unit.name].device)
        self.pending.append((unit.name, finish, None))
        self.drain(keep=1)

    def push(self, unit: Unit, full: torch.Tensor, received: Sequence[bool], reusable: bool = False) -> None:
        self._mark(unit, received, full.device)
        with plain_mode():
            if self.deferred is not None:  # summed in the reduce dtype, as FSDP2 accumulates
                total = self.deferred.get(unit.name)
                if total is None:
                    # a fresh buffer from the split's backward: ours to keep (a copy in the reduce dtype)
                    self.deferred[unit.name] = full.to(self.schedule.reduce_dtype(full.dtype))
                else:
                    total.add_(full)
                return
            with label("grads"):
                self.pending.append(
                    (unit.name, reduce_unit(self.params, unit, full, self.schedule), full if reusable else None)
                )
        self.drain(keep=1)

    def take_spare(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The last reduced full gradient if it has exactly this size (else it is let go)."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.numel() == numel and spare.dtype == dtype and spare.device == device:
            return spare
        return None

    def drain(self, keep: int = 0) -> None:
        """Wait for reduce-scatters (oldest first) until ``keep`` are left in flight."""
        while len(self.pending) > keep:
            unit, finish, full = self.pending.popleft()
            with plain_mode():
                shard = finish()
                # The reduction's closure holds the full gradient and the received shards: let them
                # go before delivering (with update_in_backward the optimizer steps the unit now).
                del finish
                # Kept for the next unit, unless the optimizer runs now (update_in_backward): its
                # temporaries would then meet this buffer at the step's peak.
                reused = full is not None and full.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()
                if reused and self.on_unit is None:
                    self.spare = full
                del full
                self._deliver(unit, shard)

    def abandon(self) -> None:
        """After a failed backward: wait for the reduce-scatters (and mask merges) in flight and drop their results."""
        while self.pending:
            _, finish, _ = self.pending.popleft()
            with plain_mode():
                finish()
        while self.reached:  # and the masks' messages: their buffers stay alive until they land
            self.reached.popitem()[1]()
        self.settle()

    def settle(self) -> None:
        """At the end of backward: wait for what is left in flight, the mask merges included."""
        self.drain()
        while self.unsettled:
            self.unsettled.pop()()

    def _deliver(self, unit: str, grad: torch.Tensor) -> None:
        total = self.totals.get(unit)
        self.totals[unit] = grad if total is None else total.add_(grad)
        self.arrived[unit] += 1
        if self.on_unit is not None and self.arrived[unit] == self.expected.get(unit, 0):
            self.delivered.append(unit)
            self.on_unit(unit, self.totals.pop(unit), self.reached.pop(unit)())

    def reduce_deferred(self) -> None:
        """``defer``: reduce-scatter every unit's summed full gradient once, now."""
        assert self.deferred is not None
        plan = self.params.plan
        for name in list(self.deferred):
            with plain_mode():
                shard = reduce_unit(self.params, plan.unit(name), self.deferred.pop(name), self.schedule)()
                self._deliver(name, shard)

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
        if layout.replicas > 1 and divides_first(out.dtype):
            all_reduce_over_(out.div_(layout.replicas), layout.replica_groups, unit.name)
        elif layout.replicas > 1:
            all_reduce_over_(out, layout.replica_groups, unit.name).div_(layout.replicas)
        return out.to(dtype=shard.dtype, device=shard.device)

    return result
