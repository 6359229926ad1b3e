"""The prefetch policy: which unit to gather next, ahead of use, within the in-flight limit.

Forward: the units run in the order they ran in the previous step (``ForwardOrder``), so
the units after this one there are gathered while this one computes, in order, while the
gathered buffers fit ``Schedule.max_inflight`` times the largest unit's (``may_start``):
two blocks at the default, or a block and the small units after it, so a small unit (a
norm) never leaves the next unit's gather (the head's) only its own short compute to hide
behind. Backward: the use whose backward comes next is refilled (``refill_next``), one
ahead, within the same limit, from this use's first gradient on (the runtime's
``before_grad``: the previous reduction has landed by then). The units that ran last in the
previous step stay gathered after their forward (``kept_tail``): backward needs them first, so
freeing them would only gather them again at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsdp_fn._plan import ROOT, Plan
from fsdp_fn._policy import Schedule
from fsdp_fn._unit import GatheredUnit, UnitState


class ForwardOrder:
    """The previous step's unit order, and where this forward has got to in it."""

    def __init__(self, previous: Sequence[str], nbytes: Mapping[str, int], schedule: Schedule) -> None:
        self.previous = list(previous)
        self.at = -1
        self.tail = kept_tail(self.previous, nbytes, schedule)

    @property
    def first(self) -> str | None:
        return self.previous[0] if self.previous else None

    def advance(self, name: str) -> list[str]:
        """``name`` runs now: the units expected after it, in order (none off the previous order)."""
        try:
            self.at = self.previous.index(name, self.at + 1)
        except ValueError:
            return []
        return self.previous[self.at + 1 :]

    def keep_gathered(self, name: str, schedule: Schedule) -> bool:
        """Whether ``name`` stays gathered after its forward: always without
        ``reshard_after_forward``; otherwise when it runs in the previous order's kept tail."""
        if not schedule.reshard_after_forward:
            return True
        return self.tail <= self.at < len(self.previous) and self.previous[self.at] == name


def kept_tail(order: Sequence[str], nbytes: Mapping[str, int], schedule: Schedule) -> int:
    """Where, in last step's forward ``order``, the uses that stay gathered after their forward
    begin: the last use, and with ``schedule.keep_tail_gathered`` and a backward prefetch the
    ones before it while their gathered bytes (``nbytes``, per unit; the root counts nothing)
    fit the in-flight cap together, which the refills at backward's start would fill anyway.
    Each saves one all-gather, and its wait, per step."""
    keep = schedule.keep_tail_gathered and schedule.backward_prefetch is not None
    limit = inflight_limit(nbytes, schedule) if keep else 0
    start, total = len(order), 0
    for at in range(len(order) - 1, -1, -1):
        total += nbytes.get(order[at], 0)
        if total > limit and at < len(order) - 1:
            break
        start = at
    return start


def gathered_bytes(plan: Plan, world: int, schedule: Schedule) -> dict[str, int]:
    """Each non-root unit's gathered bytes (trainable and frozen parts, padded, in the gather dtype)."""
    return {
        u.name: sum(
            part.padded_numel(world) * schedule.gather_dtype(part.dtype).itemsize
            for part in (u, *u.frozen_parts)
            if part.params
        )
        for u in plan.units
        if u.name != ROOT
    }


def inflight_limit(nbytes: Mapping[str, int], schedule: Schedule) -> int:
    """The gathered bytes allowed at once: ``max_inflight`` times the largest unit's (``nbytes``)."""
    return schedule.max_inflight * max(nbytes.values(), default=0)


def may_start(inflight: int, nbytes: int, limit: int) -> bool:
    """Whether a unit of ``nbytes`` may be gathered now, with ``inflight`` bytes gathered already."""
    return inflight + nbytes <= limit


def refill_next(uses: Sequence[object], current: object) -> GatheredUnit | None:
    """The use whose backward comes after ``current``'s, when it must be refilled: the last
    gathered use before it in forward order whose backward reads its parameters (a lookup's
    backward reads none; its fetched rows are no gathered use). None when that use is still
    gathered (kept after its forward, or refilled already): one use ahead only. A gathered
    use of frozen parameters alone is passed over: it gets no gradient, so no refill starts
    from it."""
    if current not in uses:
        return None
    at = list(uses).index(current)
    for use in reversed(uses[:at]):
        if not isinstance(use, GatheredUnit):
            continue
        if use.state is UnitState.GATHERED and use.unit.params:
            return None
        if use.state is UnitState.FREED and use.refill:
            return use
    return None
