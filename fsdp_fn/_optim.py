"""Optimizers as ``(init, update)`` pairs over sharded pytrees: their state is sharded by construction.

``update(grads, state, params) -> (params, state)`` runs torch's own optimizer kernels
(``torch.optim.adamw.adamw``, ``torch.optim.sgd.sgd``), so the numbers equal
``torch.optim.AdamW``/``SGD`` element for element. It updates the shard tensors in
place and returns them (the buffers are donated, as with JAX's ``donate_argnums``):
optimizer memory is exactly the sharded moments, never a second copy of the parameters.

torch.optim skips a parameter whose ``.grad`` is ``None``; so do these, per parameter:
``grads.received`` (set by ``value_and_grad``) says which parameters of each unit got a
gradient, and the others keep their values, moments and step counts. Step counts are
kept per parameter, as torch.optim keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.adamw import adamw as _adamw_kernel
from torch.optim.sgd import sgd as _sgd_kernel

from fsdp_fn._plan import Unit, unit_label
from fsdp_fn._shard import Sharded
from fsdp_fn._tree import tree_leaves, tree_map

__all__ = ["AdamWState", "Optimizer", "SGDState", "adamw", "from_torch", "sgd", "tree_leaves", "tree_map"]


class Optimizer(NamedTuple):
    """A pair of functions, as in optax: ``init(params) -> state``, ``update(grads, state, params)``.

    ``update`` steps, in place, exactly the parameters ``grads.received`` marks (all of
    them when it is ``None``), so fsdp_fn can step one unit the moment its gradient is
    ready, and skip parameters the forward never used, as torch.optim does.
    """

    init: Callable[[Sharded], Any]
    update: Callable[[Sharded, Any, Sharded], tuple[Sharded, Any]]
    links: tuple[str, ...] = ()  # what it is made of, for messages
    whole: tuple[str, ...] = ()  # the links that need the whole gradient (its global norm, a sum over calls)

    @property
    def elementwise(self) -> bool:
        """Each unit's update needs that unit's gradient alone (so ``update_in_backward`` can run it)."""
        return not self.whole


class AdamWState(NamedTuple):
    steps: Sharded  # per unit: one float32 step count per trainable parameter, shape (len(unit.params),)
    exp_avg: Sharded
    exp_avg_sq: Sharded


class SGDState(NamedTuple):
    steps: Sharded  # per unit: one float32 step count per trainable parameter
    momentum: Sharded | None  # None without momentum


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t, memory_format=torch.contiguous_format)


def _step_counts(params: Sharded) -> Sharded:
    return params.replace({u.name: torch.zeros(len(u.params), dtype=torch.float32) for u in params.plan.units})


DecayMask = Callable[[str, tuple[int, ...]], bool]
LearningRate = float | Callable[[int], float]


class _Slices(NamedTuple):
    """What one kernel call steps: parallel lists of tensors (whole shards or per-parameter views)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: list[list[torch.Tensor]]  # one list per state tensor kind (moments)
    steps: list[torch.Tensor]  # 0-d views into the per-parameter step counts
    whole: list[str]  # units stepped as one flat shard: only their first count moved
    decays: list[bool]  # per entry: whether weight decay applies


def _select(
    grads: Sharded, params: Sharded, states: list[Sharded], steps: Sharded, decay: DecayMask | None = None
) -> _Slices:
    """The tensors to step, unit by unit: a unit whose parameters all got a gradient, share
    one step count and one weight-decay choice is stepped as one flat shard (its padding is
    zero and stays zero); otherwise each received parameter's slice of this rank's shard is
    stepped on its own. Step counts of received parameters this rank holds no element of
    still advance."""
    out = _Slices([], [], [[] for _ in states], [], [], [])
    layout = params.layout
    for unit in params.plan.units:
        if not unit.params:
            continue
        mask = _mask(grads, unit)
        if not any(mask):
            continue
        counts = steps[unit.name]
        decays = [True if decay is None else bool(decay(spec.name, spec.shape)) for spec in unit.params]
        whole = all(mask) and bool((counts == counts[0]).all()) and len(set(decays)) == 1
        if whole:
            _add(out, params[unit.name], grads[unit.name], [state[unit.name] for state in states], counts[0], decays[0])
            out.whole.append(unit.name)
            continue
        for i, lo, hi in unit.local_ranges(layout.world, layout.rank):
            if not mask[i]:
                continue
            if lo == hi:
                counts[i] += 1  # no element here, but torch counts the step for the parameter
                continue
            _add(
                out,
                params[unit.name][lo:hi],
                grads[unit.name][lo:hi],
                [state[unit.name][lo:hi] for state in states],
                counts[i],
                decays[i],
            )
    return out


def _rate(lr: LearningRate, grads: Sharded, optimizer: str) -> float:
    """``lr``, or the schedule ``lr(k)`` at ``k = grads.step``, the steps applied before this one."""
    if not callable(lr):
        return lr
    if grads.step is None:
        raise ValueError(
            f"{optimizer}(lr=schedule): the schedule reads grads.step, the number of steps applied before this "
            "one; the train step sets it, and a loop of your own sets it before update (grads.step = k)"
        )
    rate = lr(grads.step)
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int | float | torch.Tensor)
        or not math.isfinite(float(rate))
        or float(rate) < 0
    ):
        raise ValueError(
            f"{optimizer}(lr=schedule): the schedule gave lr={rate!r} at step {grads.step}; a learning rate must "
            "be a finite number >= 0 (nothing was applied)"
        )
    return float(rate)


def _by_decay(todo: _Slices) -> list[tuple[bool, _Slices]]:
    """``todo``'s entries with weight decay and without: one kernel call each (a kernel takes one decay)."""
    if not todo.params:
        return []
    if len(set(todo.decays)) == 1:
        return [(todo.decays[0], todo)]
    out = []
    for decayed in (True, False):
        at = [k for k, d in enumerate(todo.decays) if d == decayed]
        part = _Slices(
            [todo.params[k] for k in at],
            [todo.grads[k] for k in at],
            [[kind[k] for k in at] for kind in todo.states],
            [todo.steps[k] for k in at],
            [],
            [decayed] * len(at),
        )
        out.append((decayed, part))
    return out


_PIECE_BYTES = 512 * 1024  # one piece of a parameter, its gradient, its moments and a temporary fit a core's L2


def _add(
    out: _Slices,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    count: torch.Tensor,
    decayed: bool,
) -> None:
    """Append one flat tensor to step; on CPU, in pieces of ``_PIECE_BYTES``.

    torch's kernels pass over each tensor several times (AdamW about seven, with a
    temporary the tensor's size): over a whole flat shard every pass streams from memory,
    over a piece the later passes read the cache (the bench GPT's shards at W=2, 16.8M
    elements: 31 -> 27-29 ms a step). Every operation is element-wise, so the result is the
    same to the bit. The first piece steps ``count`` itself; the others step copies of it, so the
    count advances once."""
    size = max(1, _PIECE_BYTES // param.element_size())
    if param.device.type != "cpu" or param.numel() <= size:
        bounds = [(0, param.numel())]
    else:
        bounds = [(lo, min(lo + size, param.numel())) for lo in range(0, param.numel(), size)]
    for k, (lo, hi) in enumerate(bounds):
        out.params.append(param[lo:hi])
        out.grads.append(grad[lo:hi])
        for kind, state in zip(out.states, states, strict=True):
            kind.append(state[lo:hi])
        out.steps.append(count if k == 0 else count.clone())
        out.decays.append(decayed)


def _sync_counts(whole: list[str], steps: Sharded) -> None:
    """After a whole-unit step only the first count moved: copy it to the others. (A unit
    stepped per parameter, whose counts differed, keeps each count as it moved.)"""
    for name in whole:
        counts = steps[name]
        counts[1:] = counts[0]


def _mask(grads: Sharded, unit: Unit) -> tuple[bool, ...]:
    received = grads.received
    if received is None:
        return (True,) * len(unit.params)
    return tuple(received.get(unit.name, (False,) * len(unit.params)))


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    weight_decay_mask: DecayMask | None = None,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Optimizer:
    """AdamW with ``torch.optim.AdamW``'s numerics. State: two moments the size of the shards.

    ``lr``: a number, or a schedule ``lr(k) -> float`` of the steps applied before this one
    (0 at the first; ``TrainState.step``, which a skipped step does not advance; with
    ``accumulate(n)``, the inner optimizer's own steps), as ``torch.optim.lr_scheduler.LambdaLR``
    stepped after each step gives ``base_lr * lr_lambda(k)``.
    ``weight_decay_mask(name, shape) -> bool``: which parameters weight decay applies to
    (default all), as torch's parameter groups with ``weight_decay=0`` for the others
    (``lambda name, shape: len(shape) >= 2`` leaves biases and norms undecayed). A unit
    whose parameters differ there is stepped a parameter at a time.

    >>> opt = adamw(lr=1e-3)
    >>> opt.init  # doctest: +ELLIPSIS
    <function adamw.<locals>.init at ...>
    """
    if (not callable(lr) and lr < 0) or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(
            f"invalid AdamW hyper-parameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
        )

    def init(params: Sharded) -> AdamWState:
        return AdamWState(_step_counts(params), tree_map(_zeros_like, params), tree_map(_zeros_like, params))

    def update(grads: Sharded, state: AdamWState, params: Sharded) -> tuple[Sharded, AdamWState]:
        todo = _select(grads, params, [state.exp_avg, state.exp_avg_sq], state.steps, weight_decay_mask)
        rate = _rate(lr, grads, "adamw") if todo.params else 0.0
        for decayed, part in _by_decay(todo):
            _adamw_kernel(
                part.params,
                part.grads,
                part.states[0],
                part.states[1],
                [],
                part.steps,
                foreach=foreach,
                amsgrad=False,
                beta1=betas[0],
                beta2=betas[1],
                lr=rate,
                weight_decay=weight_decay if decayed else 0.0,
                eps=eps,
                maximize=maximize,
            )
        _sync_counts(todo.whole, state.steps)
        return params, state

    return Optimizer(init, update, links=("adamw",))


def sgd(
    lr: LearningRate = 1e-2,
    momentum: float = 0.0,
    *,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    weight_decay_mask: DecayMask | None = None,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Optimizer:
    """SGD (with optional momentum) with ``torch.optim.SGD``'s numerics. State: one buffer per shard.

    ``lr`` (a number or a schedule) and ``weight_decay_mask`` as in ``adamw``.
    """
    if (not callable(lr) and lr < 0) or momentum < 0 or weight_decay < 0:
        raise ValueError(f"invalid SGD hyper-parameters lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")

    def init(params: Sharded) -> SGDState:
        return SGDState(_step_counts(params), tree_map(_zeros_like, params) if momentum else None)

    def update(grads: Sharded, state: SGDState, params: Sharded) -> tuple[Sharded, SGDState]:
        states = [state.momentum] if state.momentum is not None else []
        todo = _select(grads, params, states, state.steps, weight_decay_mask)
        rate = _rate(lr, grads, "sgd") if todo.params else 0.0
        for decayed, part in _by_decay(todo):
            mine = part.states[0] if states else []
            # torch starts a momentum buffer as a copy of the first gradient: a parameter
            # seen for the first time gets None, and the kernel's new buffer is copied back.
            buffers: list[torch.Tensor | None] = [None] * len(part.params)
            for k, (count, buffer) in enumerate(zip(part.steps, mine, strict=False)):
                buffers[k] = None if int(count.item()) == 0 else buffer
            _sgd_kernel(
                part.params,
                part.grads,
                buffers,
                foreach=foreach,
                weight_decay=weight_decay if decayed else 0.0,
                momentum=momentum,
                lr=rate,
                dampening=dampening,
                nesterov=nesterov,
                maximize=maximize,
            )
            for target, used in zip(mine, buffers, strict=False):
                if used is not None and used is not target:
                    target.copy_(used)
            for s in part.steps:
                s.add_(1)
        _sync_counts(todo.whole, state.steps)
        return params, state

    return Optimizer(init, update, links=("sgd",))


def from_torch(optimizer: torch.optim.Optimizer) -> Optimizer:
    """Use any ``torch.optim`` optimizer built on the shard tensors (``list(params.values())``).

    Its state lives in the optimizer object, sharded because its tensors are shards. It
    sees one tensor per unit, so it skips whole units: a unit none of whose parameters got
    a gradient is skipped (its ``.grad`` is ``None``); a unit where only some did raises,
    naming them (``adamw``/``sgd`` skip per parameter).
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
        _check(params, whole=False)
        stepped = []
        for unit in params.plan.units:
            mask = _mask(grads, unit)
            if any(mask) and not all(mask):
                unused = [spec.name for spec, got in zip(unit.params, mask, strict=True) if not got]
                raise ValueError(
                    f"parameters {unused} of unit {unit_label(unit.name)} got no gradient while the rest of the "
                    "unit did; a torch.optim optimizer on flat shards can only skip whole units: use ff.adamw or "
                    "ff.sgd (they skip per parameter, as torch.optim does)"
                )
            if unit.params and all(mask):
                params[unit.name].grad = grads[unit.name]
                stepped.append(params[unit.name])
        try:
            if stepped:
                state.step()
        finally:
            for p in stepped:
                p.grad = None
        return params, state

    return Optimizer(init, update, links=(f"from_torch({type(optimizer).__name__})",))
