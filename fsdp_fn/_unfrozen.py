"""Progressive unfreezing: parameters frozen when the plan was made, trainable now, moved into training.

A parameter frozen at ``make_plan`` lives in its unit's frozen part: no gradient buffer, no
optimizer state. Made trainable later (``requires_grad_(True)``, as FSDP2's users unfreeze
layers between steps), it joins its unit's trainable part, after the parameters there, and
gets the optimizer state its ``init`` gives a new parameter (torch.optim makes it at the
parameter's first gradient: zero moments, step 0). What the other parameters hold is kept.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_fn._base import GradientTransformation
from fsdp_fn._collectives import all_gather_into
from fsdp_fn._plan import Plan, Unit, unit_label
from fsdp_fn._shard import Layout, Sharded, local_slice, unit_views

# The fields of an optimizer state that hold one value per trainable parameter (step
# counts), not one per element: named as the checkpoints name them (checkpoint/_opt_state.py).
_PER_PARAMETER = ("count", "step")


def train_unfrozen(
    params: Sharded, opt_state: Any, optimizer: GradientTransformation, module: nn.Module
) -> tuple[Sharded, Any]:
    """Move the parameters ``module`` has unfrozen since the plan into training.

    Each joins its unit's trainable part (a new plan, ``Plan.with_trainable``), so its
    gradient is reduced and stepped from the next step on, with the optimizer state
    ``optimizer.init`` gives it; the other parameters' values and state are kept exactly.
    ``train_step`` does this by itself; a loop of ``value_and_grad`` and ``update`` calls it
    after changing ``requires_grad``. Every rank must unfreeze the same parameters.
    Memory: per changed unit, its full flat buffers and its fresh state for a moment (once); communication:
    per changed unit, one all-gather of each of its shards (parameters, frozen part, each
    optimizer tree). Nothing is communicated when nothing was unfrozen.

    Args:
        params: the sharded parameters, made with the plan that holds them frozen.
        opt_state: ``optimizer``'s state for ``params``.
        optimizer: the gradient transformation whose state ``opt_state`` is.
        module: the module the plan was made for, with its ``requires_grad`` flags as now.

    Returns:
        ``(params, opt_state)`` under the new plan (the same ones when nothing was unfrozen).

    Raises:
        ValueError: if an unfrozen parameter's dtype is not its unit's trainable dtype.
        TypeError: if ``opt_state`` is a ``from_torch`` optimizer (its state lives in torch's object).
    """
    unfrozen = params.plan.unfrozen(module)
    if not unfrozen:
        return params, opt_state
    if isinstance(opt_state, torch.optim.Optimizer):
        raise TypeError(
            f"parameters {sorted(unfrozen)} were unfrozen after the plan was made, and a from_torch optimizer keeps "
            "its state in torch's object, which fsdp_fn cannot extend; use ff.adamw / ff.sgd, or make a new plan"
        )
    old, new = params.plan, params.plan.with_trainable(unfrozen)
    changed = [u.name for u, v in zip(old.units, new.units, strict=True) if u != v]
    layout = params.layout
    frozen = dict(layout.frozen)
    shards = dict(params.shards)
    with torch.no_grad():
        for name in changed:
            u, v = old.unit(name), new.unit(name)
            full: dict[str, torch.Tensor] = {}
            for frozen_part, frozen_shard in zip(u.frozen_parts, frozen.pop(name), strict=True):
                full |= unit_views(frozen_part, _gathered(frozen_shard, layout))
            if u.params:
                full |= unit_views(u, _gathered(params[name], layout))
            shards[name] = local_slice(v, full, layout.world, layout.rank)
            if v.frozen:
                frozen[name] = tuple(local_slice(f, full, layout.world, layout.rank) for f in v.frozen_parts)
        moved = Sharded(shards, Layout(new, layout.axes, frozen))
        # The new parameters' state as init makes it, for the changed units alone (not a second whole state).
        part = Layout(
            Plan(tuple(new.unit(n) for n in changed)), layout.axes, {n: frozen[n] for n in changed if n in frozen}
        )
        fresh = optimizer.init(Sharded({n: shards[n] for n in changed}, part))
        return moved, _merged(opt_state, fresh, old, changed, moved.layout)


def _gathered(shard: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The full (padded) flat buffer of one unit from this rank's shard: one all-gather."""
    full = shard.new_empty(shard.numel() * layout.world)
    all_gather_into(full, shard.contiguous(), layout.group, None)
    return full


def _merged(old: Any, fresh: Any, plan: Plan, changed: list[str], layout: Layout, field: str = "") -> Any:
    """``fresh`` (the new plan's ``init``) with the old state put back wherever it exists."""
    if isinstance(old, Sharded):
        assert isinstance(fresh, Sharded)
        shards = dict(old.shards)
        for name in changed:
            shards[name] = _kept(plan.unit(name), old[name], fresh[name], layout, field in _PER_PARAMETER)
        received = None
        if old.received is not None:
            received = dict(old.received)
            for name in changed:
                mask = old.mask(plan.unit(name))
                received[name] = mask + (False,) * (len(fresh.plan.unit(name).params) - len(mask))
        return Sharded(shards, layout, received)
    if isinstance(old, tuple):
        names = getattr(old, "_fields", None) or [""] * len(old)
        items = [_merged(o, f, plan, changed, layout, n) for n, o, f in zip(names, old, fresh, strict=True)]
        return type(old)(*items) if hasattr(old, "_fields") else tuple(items)
    if isinstance(old, dict):
        return {k: _merged(v, fresh[k], plan, changed, layout, str(k)) for k, v in old.items()}
    return old  # plain values (a schedule's count) are the optimizer's, not a parameter's


def _kept(unit: Unit, old: torch.Tensor, fresh: torch.Tensor, layout: Layout, per_parameter: bool) -> torch.Tensor:
    """One changed unit's state: the old parameters' values, then the new ones' fresh values."""
    if per_parameter:
        return torch.cat([old, fresh[len(unit.params) :]])
    if old.shape != (unit.shard_numel(layout.world),):
        raise ValueError(
            f"an optimizer state's tree of unit {unit_label(unit.name)} has shards of shape {tuple(old.shape)}, "
            "neither one value per element nor per parameter: fsdp_fn cannot extend it to the unfrozen parameters"
        )
    full = _gathered(old, layout)[: unit.numel]
    fresh_full = _gathered(fresh, layout)
    fresh_full[: unit.numel] = full.to(fresh_full.dtype)
    n = fresh.numel()
    return fresh_full[layout.rank * n : (layout.rank + 1) * n].clone()
