"""Gradient transformations as ``(init, update)`` values that chain, as in optax.

A ``GradientTransformation`` maps gradients to gradients: ``update(grads, state, params)
-> (grads, state)``. An ``Optimizer`` (``adamw``, ``sgd``, ``from_torch``) is the last link
and applies them: ``update(grads, state, params) -> (params, state)``, with torch's own
kernels, so parity with torch.optim stays exact. ``chain(t1, t2, ..., optimizer)`` is an
``Optimizer``; ``apply_if_finite`` and ``accumulate`` wrap one.

Every tree is ``Sharded``: transformations run on this rank's shards. What needs the
whole gradient (its global norm) takes ``grads.norm`` when the train step has computed it
in its one metrics all-gather, and otherwise all-reduces one number.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsdp_fn._collectives import all_reduce_
from fsdp_fn._norms import square_norm
from fsdp_fn._optim import Optimizer
from fsdp_fn._shard import Sharded

__all__ = [
    "AccumulateState",
    "ApplyIfFiniteState",
    "GradientTransformation",
    "accumulate",
    "apply_if_finite",
    "chain",
    "clip_by_global_norm",
    "global_norm",
]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (grads, state)``.

    ``links``: names, for messages; ``whole``: the links that need the whole gradient (the
    others are elementwise: each unit's result depends on that unit's gradient alone, so
    they can run unit by unit during backward, ``update_in_backward``).
    """

    init: Callable[[Sharded], Any]
    update: Callable[[Sharded, Any, Sharded], tuple[Sharded, Any]]
    links: tuple[str, ...] = ()
    whole: tuple[str, ...] = ()

    @property
    def elementwise(self) -> bool:
        return not self.whole


def _received_units(grads: Sharded) -> list[str]:
    received = grads.received
    return [u for u in grads.plan.unit_names if received is None or any(received.get(u, ()))]


def global_norm(grads: Sharded) -> torch.Tensor:
    """The L2 norm of the whole (unsharded) gradient, as a 0-d float64 tensor, on every rank.

    ``grads.norm`` when the step computed it; otherwise the squared norms of this rank's
    shards (``square_norm``: exact at any size; padding is zero) all-reduced over the group (and averaged
    over replicas, which hold the same shards). Communication: none, or one all-reduce of
    one number (two with replicas).
    """
    if grads.norm is not None:
        return grads.norm
    layout = grads.layout
    square = torch.zeros((), dtype=torch.float64)
    for u in _received_units(grads):
        square += square_norm(grads[u]).cpu()
    all_reduce_(square, layout.group)
    if layout.replicate is not None:
        all_reduce_(square, layout.replicate).div_(layout.replicas)
    return square.sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the gradients so their global norm is at most ``max_norm``, in place:
    ``torch.nn.utils.clip_grad_norm_``'s rule (``coef = min(1, max_norm / (norm + 1e-6))``).

    >>> clip_by_global_norm(1.0).elementwise
    False
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive finite number, got {max_norm!r}")

    def init(params: Sharded) -> tuple[()]:
        return ()

    def update(grads: Sharded, state: tuple[()], params: Sharded) -> tuple[Sharded, tuple[()]]:
        coef = torch.clamp(max_norm / (global_norm(grads).float() + 1e-6), max=1.0)
        for u in _received_units(grads):
            grads[u].mul_(coef.to(grads[u].device))
        return grads, state

    name = f"clip_by_global_norm({max_norm:g})"
    return GradientTransformation(init, update, links=(name,), whole=(name,))


class ChainState(NamedTuple):
    states: tuple[Any, ...]


def chain(*links: GradientTransformation | Optimizer) -> Optimizer:
    """Gradient transformations applied in order, then the optimizer (the last link).

    >>> from fsdp_fn import adamw
    >>> chain(clip_by_global_norm(1.0), adamw()).links
    ('clip_by_global_norm(1)', 'adamw')
    """
    if not links or not isinstance(links[-1], Optimizer):
        raise TypeError("chain(...) must end with an optimizer (adamw(), sgd(), from_torch(...)) that applies updates")
    transforms, optimizer = links[:-1], links[-1]
    bad = [t for t in transforms if not isinstance(t, GradientTransformation)]
    if bad:
        raise TypeError(
            f"chain: only its last link applies updates; the others must be gradient transformations, got {bad!r}"
        )

    def init(params: Sharded) -> ChainState:
        return ChainState(tuple(link.init(params) for link in links))

    def update(grads: Sharded, state: ChainState, params: Sharded) -> tuple[Sharded, ChainState]:
        states = list(state.states)
        for i, t in enumerate(transforms):
            grads, states[i] = t.update(grads, states[i], params)
        params, states[-1] = optimizer.update(grads, states[-1], params)
        return params, ChainState(tuple(states))

    names = tuple(n for link in links for n in link.links)
    whole = tuple(n for link in links for n in link.whole)
    return Optimizer(init, update, links=names, whole=whole)


class ApplyIfFiniteState(NamedTuple):
    inner: Any
    last_finite: bool  # whether the last update was applied
    notfinite_count: int  # non-finite updates in a row
    total_notfinite: int


def apply_if_finite(inner: Optimizer) -> Optimizer:
    """Apply ``inner`` only when the gradients' global norm is finite (no NaN or inf
    anywhere, on any rank); otherwise leave parameters and ``inner``'s state as they were.
    The decision is the same on every rank (the norm is global)."""
    if not isinstance(inner, Optimizer):
        raise TypeError(f"apply_if_finite wraps an optimizer or a chain ending in one, got {inner!r}")

    def init(params: Sharded) -> ApplyIfFiniteState:
        return ApplyIfFiniteState(inner.init(params), True, 0, 0)

    def update(grads: Sharded, state: ApplyIfFiniteState, params: Sharded) -> tuple[Sharded, ApplyIfFiniteState]:
        if not bool(torch.isfinite(global_norm(grads))):
            return params, ApplyIfFiniteState(state.inner, False, state.notfinite_count + 1, state.total_notfinite + 1)
        params, inner_state = inner.update(grads, state.inner, params)
        return params, ApplyIfFiniteState(inner_state, True, 0, state.total_notfinite)

    return Optimizer(init, update, links=("apply_if_finite", *inner.links), whole=("apply_if_finite", *inner.whole))


class AccumulateState(NamedTuple):
    inner: Any
    mini_step: int  # gradients summed so far in this round
    summed: Sharded  # their sum (shards)
    received: frozenset[str]  # the parameters that got a gradient in any of them, by name (any plan's)


def accumulate(every: int, inner: Optimizer) -> Optimizer:
    """Sum the gradients of ``every`` calls and apply ``inner`` to their mean on the last one
    (optax's ``MultiSteps``); the other calls leave the parameters as they are. Memory: one
    gradient shard per unit; no communication of its own."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"accumulate: every must be a whole number of calls >= 1, got {every!r}")
    if not isinstance(inner, Optimizer):
        raise TypeError(f"accumulate wraps an optimizer or a chain ending in one, got {inner!r}")

    def init(params: Sharded) -> AccumulateState:
        zeros = params.replace({u: torch.zeros_like(params[u]) for u in params.plan.unit_names})
        return AccumulateState(inner.init(params), 0, zeros, frozenset())

    def update(grads: Sharded, state: AccumulateState, params: Sharded) -> tuple[Sharded, AccumulateState]:
        received = set(state.received)
        for unit in params.plan.units:
            mask = (True,) * len(unit.params) if grads.received is None else grads.received.get(unit.name)
            if mask is None:
                continue
            state.summed[unit.name].add_(grads[unit.name])
            received.update(spec.name for spec, got in zip(unit.params, mask, strict=True) if got)
        mini_step = state.mini_step + 1
        if mini_step < every:
            return params, AccumulateState(state.inner, mini_step, state.summed, frozenset(received))
        masks = {u.name: tuple(spec.name in received for spec in u.params) for u in params.plan.units}
        mean = state.summed.like({u: g / every for u, g in state.summed.shards.items()})
        mean = mean.with_received({u: mask for u, mask in masks.items() if any(mask)})
        mean.step = None if grads.step is None else grads.step // every  # the inner optimizer's own steps
        params, inner_state = inner.update(mean, state.inner, params)
        for g in state.summed.values():
            g.zero_()
        return params, AccumulateState(inner_state, 0, state.summed, frozenset())

    name = f"accumulate({every})"
    return Optimizer(init, update, links=(name, *inner.links), whole=(name, *inner.whole))
