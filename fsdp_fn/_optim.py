"""Optimizers as ``(init, update)`` pairs over sharded pytrees: their state is sharded by construction.

``update(grads, state, params) -> (params, state)`` runs torch's own optimizer kernels
(``torch.optim.adamw.adamw``, ``torch.optim.sgd.sgd``), so the numbers equal
``torch.optim.AdamW``/``SGD`` element for element. It updates the shard tensors in
place and returns them (the buffers are donated, as with JAX's ``donate_argnums``):
optimizer memory is exactly the sharded moments, never a second copy of the parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch.optim.adamw import adamw as _adamw_kernel
from torch.optim.sgd import sgd as _sgd_kernel

from fsdp_fn._shard import NAMESPACE, Sharded


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` that sees through ``Sharded`` (its namespace is ``"fsdp_fn"``)."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)  # type: ignore[no-any-return]


def select_units(tree: Any, units: list[str]) -> Any:
    """``tree`` with every ``Sharded`` in it cut down to ``units`` (a dict of their shards)."""
    return optree.tree_map(
        lambda x: {u: x[u] for u in units} if isinstance(x, Sharded) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Sharded),
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


class Optimizer(NamedTuple):
    """A pair of functions, as in optax: ``init(params) -> state``, ``update(grads, state, params)``.

    ``update`` works elementwise on any selection of units (``select_units`` of all three
    trees) and writes the shards and its state in place, so fsdp_fn can step a unit the
    moment its gradient is ready, or skip units the forward never used.
    """

    init: Callable[[Sharded], Any]
    update: Callable[[Sharded, Any, Sharded], tuple[Sharded, Any]]


class AdamWState(NamedTuple):
    steps: Sharded  # a 0-d step counter per unit (torch's kernels keep one per tensor)
    exp_avg: Sharded
    exp_avg_sq: Sharded


class SGDState(NamedTuple):
    steps: Sharded  # a 0-d step counter per unit
    momentum: Sharded | None  # None without momentum


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t, memory_format=torch.contiguous_format)


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Optimizer:
    """AdamW with ``torch.optim.AdamW``'s numerics. State: two moments the size of the shards.

    >>> opt = adamw(lr=1e-3)
    >>> opt.init  # doctest: +ELLIPSIS
    <function adamw.<locals>.init at ...>
    """
    if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(
            f"invalid AdamW hyper-parameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
        )

    def init(params: Sharded) -> AdamWState:
        return AdamWState(
            tree_map(lambda t: torch.zeros((), dtype=torch.float32), params),
            tree_map(_zeros_like, params),
            tree_map(_zeros_like, params),
        )

    def update(grads: Sharded, state: AdamWState, params: Sharded) -> tuple[Sharded, AdamWState]:
        _adamw_kernel(
            tree_leaves(params),
            tree_leaves(grads),
            tree_leaves(state.exp_avg),
            tree_leaves(state.exp_avg_sq),
            [],
            tree_leaves(state.steps),
            foreach=foreach,
            amsgrad=False,
            beta1=betas[0],
            beta2=betas[1],
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
        )
        return params, state

    return Optimizer(init, update)


def sgd(
    lr: float = 1e-2,
    momentum: float = 0.0,
    *,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Optimizer:
    """SGD (with optional momentum) with ``torch.optim.SGD``'s numerics. State: one buffer per shard."""
    if lr < 0 or momentum < 0 or weight_decay < 0:
        raise ValueError(f"invalid SGD hyper-parameters lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")

    def init(params: Sharded) -> SGDState:
        steps = tree_map(lambda t: torch.zeros((), dtype=torch.float32), params)
        return SGDState(steps, tree_map(_zeros_like, params) if momentum else None)

    def update(grads: Sharded, state: SGDState, params: Sharded) -> tuple[Sharded, SGDState]:
        buffers: list[torch.Tensor | None] = [None] * len(tree_leaves(params))
        if state.momentum is not None:
            buffers = list(tree_leaves(state.momentum))
            # torch starts a buffer as a copy of the first gradient; zeros + gradient is the
            # same thing unless dampening scales the gradient.
            if dampening:
                first = [int(s.item()) == 0 for s in tree_leaves(state.steps)]
                buffers = [None if f else b for f, b in zip(first, buffers, strict=True)]
        _sgd_kernel(
            tree_leaves(params),
            tree_leaves(grads),
            buffers,
            foreach=foreach,
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=maximize,
        )
        if state.momentum is not None:
            for mine, used in zip(tree_leaves(state.momentum), buffers, strict=True):
                if used is not None and used is not mine:
                    mine.copy_(used)
        for s in tree_leaves(state.steps):
            s.add_(1)
        return params, state

    return Optimizer(init, update)


def from_torch(optimizer: torch.optim.Optimizer) -> Optimizer:
    """Use any ``torch.optim`` optimizer built on the shard tensors (``list(params.values())``).

    Its state lives in the optimizer object, sharded because its tensors are shards.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"from_torch wants a torch.optim.Optimizer, got {type(optimizer).__name__}")

    def _check(params: Sharded, whole: bool) -> list[torch.Tensor]:
        shards = tree_leaves(params)
        theirs = [p for g in optimizer.param_groups for p in g["params"]]
        ids = {id(p) for p in theirs}
        foreign = [tuple(p.shape) for p in theirs if id(p) not in {id(t) for t in shards}]
        missing = [t for t in shards if id(t) not in ids]
        if (foreign and whole) or missing:
            raise ValueError(
                f"the torch optimizer holds {len(theirs)} tensors, {len(foreign)} of them not this "
                f"state's shards (shapes {foreign[:4]}): it was built on other tensors (the module's "
                "unsharded parameters?); build it on list(params.values()) of the sharded params"
            )
        return shards

    def init(params: Sharded) -> torch.optim.Optimizer:
        _check(params, whole=True)
        return optimizer

    def update(grads: Sharded, state: torch.optim.Optimizer, params: Sharded) -> tuple[Sharded, torch.optim.Optimizer]:
        shards = _check(params, whole=False)  # any selection of units may step
        for p, g in zip(shards, tree_leaves(grads), strict=True):
            p.grad = g
        try:
            state.step()
        finally:
            for p in shards:
                p.grad = None
        return params, state

    return Optimizer(init, update)
