"""The prefetch policy: which unit to gather next, ahead of use, within the in-flight limit.

Forward: the units run in the order they ran in the previous step (``ForwardOrder``), so
the units after this one there are gathered while this one computes, in order, while the
gathered buffers fit ``Schedule.max_inflight`` times the largest unit's (``may_start``):
two blocks at the default, or a block and the small units after it, so a small unit (a
norm) never leaves the next unit's gather (the head's) only its own short compute to hide
behind. Backward: the use whose backward comes next is refilled (``refill_next``), one
ahead, within the same limit, from this use's first gradient on (the runtime's
``before_grad``: the previous reduction has landed by then). The unit that ran last in the previous step is kept
gathered after its forward (it is the first needed in backward).
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_fn._policy import Schedule
from fsdp_fn._unit import GatheredUnit, UnitState


class ForwardOrder:
    """The previous step's unit order, and where this forward has got to in it."""

    def __init__(self, previous: Sequence[str]) -> None:
        self.previous = list(previous)
        self.at = -1

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
        ``reshard_after_forward``; otherwise only the unit that ran last, needed again first."""
        if not schedule.reshard_after_forward:
            return True
        return bool(self.previous) and self.at == len(self.previous) - 1 and self.previous[-1] == name


def may_start(inflight: int, nbytes: int, limit: int) -> bool:
    """Whether a unit of ``nbytes`` may be gathered now, with ``inflight`` bytes gathered already."""
    return inflight + nbytes <= limit


def refill_next(uses: Sequence[object], current: object) -> GatheredUnit | None:
    """The use whose backward comes after ``current``'s: the last freed gathered use before it in
    forward order that its backward refills (a lookup's backward reads no parameter; its
    fetched rows are no gathered use)."""
    if current not in uses:
        return None
    at = list(uses).index(current)
    earlier = (u for u in reversed(uses[:at]) if isinstance(u, GatheredUnit))
    return next((u for u in earlier if u.state is UnitState.FREED and u.refill), None)
