"""Ranks compare small facts before they communicate, so divergence is an error, not a hang."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist


class DivergenceError(RuntimeError):
    """Ranks of one group disagree about something every rank must share (plan, schedule, ...)."""


_MISSING = "<absent>"


def agree(group: dist.ProcessGroup, what: str, facts: Mapping[str, Any], hint: str = "") -> None:
    """Raise ``DivergenceError`` on every rank unless all ranks hold the same ``facts``.

    Communication: one ``all_gather_object`` of ``facts`` (keep them small). The error
    names the first differing key and which ranks hold which value.
    """
    if group.size() == 1:
        return
    gathered: list[Any] = [None] * group.size()
    dist.all_gather_object(gathered, dict(facts), group=group)
    keys = list(dict.fromkeys(k for g in gathered for k in g))
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, g in enumerate(gathered):
            by_value.setdefault(repr(g.get(key, _MISSING)), []).append(rank)
        if len(by_value) > 1:
            parts = "; ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}" for v, r in by_value.items()
            )
            raise DivergenceError(f"{what} differ between ranks at {key}: {parts}" + (f". {hint}" if hint else ""))
