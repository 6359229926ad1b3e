"""Ranks compare small facts before they communicate, so divergence is an error, not a hang."""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn._comm import Polled
from fsdp_fn._errors import DivergenceError

__all__ = ["DivergenceError", "agree", "failures", "gather_objects"]

_MISSING = "<absent>"


def gather_objects(obj: Any, group: dist.ProcessGroup, what: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order.

    Two all-gathers (the sizes, then the padded bytes), the backend's own, polled through
    the active guard (``_comm.Polled``), so a rank that never joins is an error, not a hang (``all_gather_object``
    blocks without a deadline).
    """
    world = group.size()
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.empty(world, dtype=torch.int64)
    work = dist.all_gather_single(sizes, torch.tensor([data.numel()]), group=group, async_op=True)
    Polled([work], lambda: what).wait()
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    everyone = torch.empty(world * longest, dtype=torch.uint8)
    work = dist.all_gather_single(everyone, padded, group=group, async_op=True)
    Polled([work], lambda: what).wait()
    rows = everyone.view(world, longest)
    return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(world)]


def agree(group: dist.ProcessGroup, what: str, facts: Mapping[str, Any], hint: str = "") -> None:
    """Raise ``DivergenceError`` on every rank unless all ranks hold the same ``facts``.

    Communication: two small all-gathers of ``facts`` (keep them small). The error names
    the first differing key and which ranks hold which value.
    """
    if group.size() == 1:
        return
    gathered = gather_objects(dict(facts), group, f"comparison of the {what}")
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


def failures(error: str | None, groups: Sequence[dist.ProcessGroup | None], what: str) -> list[str]:
    """Every rank's ``error`` over ``groups`` in turn, as ``rank R: error`` (R global), or [] when
    no rank has one: a barrier over each group that carries failures, so a rank that failed
    alone is reported on every rank instead of leaving them waiting. Communication: two small
    all-gathers per group (``gather_objects``)."""
    found = [] if error is None else [f"rank {dist.get_rank()}: {error}"]
    for group in groups:
        if group is not None:
            found = list(dict.fromkeys(m for theirs in gather_objects(found, group, what) for m in theirs))
    return found
