"""Which parameters got a gradient, on any rank: one representation, and the merges of it.

A mask says, per unit, which of its trainable parameters a backward reached (a tuple of
bools in plan order). torch steps what the global batch reached, so masks are OR'd over the
ranks (and over the replicas with hybrid sharding) before an optimizer reads them. Three
callers merge at three times, all through here:

* the train step, inside its one metrics all-gather: ``pack`` the bits into float64 numbers
  (48 bits each, exact), OR the ranks' rows with ``unpack_any``;
* ``value_and_grad``: ``merge``, one all-reduce of a flag per parameter;
* ``update_in_backward``: ``merge_start``, one unit's flags beside its reduce-scatter;

each followed by ``over_replicas`` when there are replicas.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fsdp_fn._collectives import all_reduce_over_, all_reduce_start
from fsdp_fn._plan import Plan
from fsdp_fn._shard import Layout

Masks = Mapping[str, tuple[bool, ...]]

BITS = 48  # per float64 number: exact as an integer


def flags(masks: Masks, plan: Plan) -> list[bool]:
    """Every trainable parameter's bit, in plan order (a unit absent from ``masks``: none reached)."""
    return [b for u in plan.units for b in masks.get(u.name, (False,) * len(u.params))]


def from_flags(values: list[bool], plan: Plan) -> dict[str, tuple[bool, ...]]:
    """``flags``' inverse: the masks by unit."""
    out, at = {}, 0
    for u in plan.units:
        out[u.name] = tuple(values[at : at + len(u.params)])
        at += len(u.params)
    return out


def words(plan: Plan) -> int:
    """How many float64 numbers ``pack`` makes for ``plan``."""
    return -(-sum(len(u.params) for u in plan.units) // BITS)


def pack(masks: Masks, plan: Plan) -> torch.Tensor:
    """The masks as float64 numbers of ``BITS`` bits each (a step's metrics carry them)."""
    bits = flags(masks, plan)
    packed = [sum(1 << k for k, b in enumerate(bits[at : at + BITS]) if b) for at in range(0, len(bits), BITS)]
    return torch.tensor(packed, dtype=torch.float64)


def unpack_any(rows: torch.Tensor, plan: Plan) -> tuple[dict[str, tuple[bool, ...]], bool]:
    """The ranks' packed masks (one row each) OR'd: which parameters any rank reached, and
    whether every rank reached the same.

    >>> from fsdp_fn._plan import ParamSpec, Plan, Unit
    >>> plan = Plan((Unit("a", (ParamSpec("a.w", (2,), torch.float32), ParamSpec("a.b", (1,), torch.float32))),))
    >>> rows = torch.stack([pack({"a": (True, False)}, plan), pack({"a": (False, False)}, plan)])
    >>> unpack_any(rows, plan)
    ({'a': (True, False)}, False)
    """
    bits = rows.cpu().to(torch.int64)
    same = bool((bits == bits[0]).all())
    merged = [int(w) for w in functools.reduce(torch.bitwise_or, bits.unbind(0))]
    total = sum(len(u.params) for u in plan.units)
    return from_flags([bool(merged[i // BITS] >> (i % BITS) & 1) for i in range(total)], plan), same


def over_replicas(
    merged: Masks, layout: Layout, carry: torch.Tensor | None = None
) -> tuple[dict[str, tuple[bool, ...]], torch.Tensor | None]:
    """OR ``merged`` over the replicas (a parameter only another replica's batch reached is
    stepped here too), in one all-reduce that also sums ``carry`` (a step's loss and norm);
    without replicas, as they are."""
    plan = layout.plan
    if not layout.replica_groups:
        return dict(merged), carry
    head = carry if carry is not None else torch.zeros(0, dtype=torch.float64)
    mine = torch.tensor(flags(merged, plan), dtype=head.dtype, device=head.device)
    both = all_reduce_over_(torch.cat([head, mine]), layout.replica_groups)
    n = head.numel()
    return from_flags((both[n:] > 0).tolist(), plan), (both[:n] if carry is not None else None)


def merge(masks: Masks, layout: Layout) -> dict[str, tuple[bool, ...]]:
    """Which parameters any rank reached: one all-reduce of a flag per parameter (and one over
    the replicas). Over the group, as the peers' messages (``all_reduce_start``: through the
    group's rings on one host), not one of gloo's own all-reduces over TCP."""
    plan = layout.plan
    flat = torch.tensor([float(b) for b in flags(masks, plan)], dtype=torch.float32)
    if flat.numel() and layout.world > 1:
        flat = all_reduce_start(flat, layout.group)()
    if flat.numel():
        all_reduce_over_(flat, layout.replica_groups)
    return from_flags((flat > 0).tolist(), plan)


def merge_start(
    layout: Layout, unit: str, mask: tuple[bool, ...], device: torch.device, unsettled: list[Callable[[], Any]]
) -> Callable[[], tuple[bool, ...]]:
    """Issue the merge of one unit's mask over the ranks (and replicas); the result gives which
    parameters any rank reached. One message of a number per parameter to each peer, issued
    now (beside the unit's reduce-scatter). When this rank reached them all (the usual case)
    the answer is known: the result waits for nothing (no host sync on a GPU) and leaves the
    messages to ``unsettled``; with replicas it waits, as the replica group's merge needs
    this group's."""
    finish = all_reduce_start(torch.tensor(mask, dtype=torch.float32, device=device), layout.group, unit)

    def result() -> tuple[bool, ...]:
        if all(mask) and not layout.replica_groups:
            unsettled.append(finish)
            return mask
        got = finish()
        all_reduce_over_(got, layout.replica_groups, unit)
        return tuple(bool(f) for f in (got > 0).tolist())

    return result
