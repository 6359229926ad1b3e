"""``gather_for``: the differentiable all-gather of one unit, the public piece of the pair."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_fn._collectives import all_gather, replicate
from fsdp_fn._plan import Unit
from fsdp_fn._shard import Layout, Sharded, check_shard, ensure_live, unit_views


def gather_for(unit: str | Unit) -> Callable[[Sharded], dict[str, torch.Tensor]]:
    """Make the differentiable all-gather of one unit: ``gather_for(unit)(params) -> {name: full}``.

    The full parameters are views into one gathered flat buffer. The backward is the
    reduce-scatter, averaged over ranks (like DDP). Works inside ``torch.func.grad``,
    ``grad_and_value`` and ``vjp``. The unit's frozen parameters come too, gathered into
    buffers of their own (one per dtype, an integer one in its own) that need no gradient.
    Memory: the unit's full parameters (padded); communication: one all-gather forward (one
    more per dtype of frozen parameters), one reduce-scatter backward (and, with hybrid
    sharding, one all-reduce over the replicas).

    Args:
        unit: the unit, or its name in the plan of the ``Sharded`` the gather is given.

    Returns:
        ``gather(params) -> {name: full parameter}``: the unit's full parameters, trainable
        and frozen, by fully-qualified name. ``gather`` raises ``KeyError`` if the plan of
        ``params`` has no such unit, ``RuntimeError`` if ``params`` was donated to a train
        step (or left half-updated by a failed one), and ``ValueError`` if the unit's shard
        has the wrong length for the world size.
    """
    name = unit.name if isinstance(unit, Unit) else unit

    def gather(params: Sharded) -> dict[str, torch.Tensor]:
        ensure_live(params, "gather_for")
        u = params.plan.unit(name)
        full = unit_views(u, gather_differentiably(check_shard(params, u), params.layout, u.name))
        if u.frozen:
            with torch.no_grad():
                for part, frozen in zip(u.frozen_parts, params.layout.frozen[u.name], strict=True):
                    full.update(unit_views(part, gather_differentiably(frozen.detach(), params.layout, u.name)))
        return full

    return gather


def gather_differentiably(shard: torch.Tensor, layout: Layout, unit: str) -> torch.Tensor:
    """The full flat buffer of a unit from this rank's shard: its backward averages the
    gradient over the shard group (reduce-scatter) and, with hybrid sharding, over the
    replicas (all-reduce), so every ``torch.func`` transform sees the mean over all ranks,
    at every order (a shard made from a gradient: ``_collectives.regather``)."""
    for axis in layout.replica_axes:
        shard = replicate(shard, axis.group, unit=unit, grad_scale=1.0 / axis.size)
    return all_gather(shard, layout.group, unit=unit, grad_scale=1.0 / layout.world)
