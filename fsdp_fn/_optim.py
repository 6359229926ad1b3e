"""Optimizers: chains of building blocks (``_transforms.py``), as optax's, with torch's numerics.

``adamw`` is ``chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))``
(optax's ``adamw``); ``adam`` and ``sgd`` put the decay first (torch's L2 form); ``lion``
is optax's. Their ``update`` is functional, as every transformation's; their ``fused``
form, what the train step runs on donated buffers, calls torch's own kernels
(``torch.optim.adamw.adamw``, ``adam``, ``sgd``) in place, so a step equals
``torch.optim.AdamW``/``Adam``/``SGD`` element for element and holds exactly the sharded
moments, never a second copy of parameters or state.

torch.optim skips a parameter whose ``.grad`` is ``None``; so do these, per parameter:
``grads.received`` says which parameters of each unit got a gradient, and the others keep
their values, moments and step counts. Step counts are kept per parameter, as torch.optim
keeps them; a learning-rate schedule reads the chain's own count of applied updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.adam import adam as _adam_kernel
from torch.optim.adamw import adamw as _adamw_kernel
from torch.optim.sgd import sgd as _sgd_kernel

from fsdp_fn._base import GradientTransformation, Params, Updates, chain, update_in_place
from fsdp_fn._plan import unit_label
from fsdp_fn._shard import Sharded
from fsdp_fn._transforms import (
    ScalarOrSchedule,
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    check_rate,
    rate_at,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    trace,
)
from fsdp_fn._tree import tree_leaves, tree_map

__all__ = ["adam", "adamw", "from_torch", "lion", "sgd", "tree_leaves", "tree_map"]

DecayMask = Callable[[str, tuple[int, ...]], bool]
LearningRate = ScalarOrSchedule


class _Slices(NamedTuple):
    """What one kernel call steps: parallel lists of tensors (whole shards or per-parameter views)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: list[list[torch.Tensor]]  # one list per state tensor kind (moments)
    steps: list[torch.Tensor]  # 0-d views into the per-parameter step counts
    whole: list[str]  # units stepped as one flat shard: only their first count moved
    decays: list[bool]  # per entry: whether weight decay applies


def _select(
    grads: Sharded, params: Sharded, states: list[Sharded], steps: Sharded | None, decay: DecayMask | None = None
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
        mask = grads.mask(unit)
        if not any(mask):
            continue
        counts = steps[unit.name] if steps is not None else torch.zeros(len(unit.params))
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
    size, numel = max(1, _PIECE_BYTES // param.element_size()), param.numel()
    if param.device.type != "cpu" or numel <= size:  # one piece: the tensors as they are (no views)
        pieces = [(param, grad, states)]
    else:
        bounds = [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]
        pieces = [(param[lo:hi], grad[lo:hi], [state[lo:hi] for state in states]) for lo, hi in bounds]
    for k, (p, g, piece_states) in enumerate(pieces):
        out.params.append(p)
        out.grads.append(g)
        for kind, state in zip(out.states, piece_states, strict=True):
            kind.append(state)
        out.steps.append(count if k == 0 else count.clone())
        out.decays.append(decayed)


def _sync_counts(whole: list[str], steps: Sharded | None) -> None:
    """After a whole-unit step only the first count moved: copy it to the others. (A unit
    stepped per parameter, whose counts differed, keeps each count as it moved.)"""
    if steps is None:
        return
    for name in whole:
        counts = steps[name]
        counts[1:] = counts[0]


def _rate(lr: LearningRate, state: Any, where: str) -> tuple[float, Any]:
    """The learning rate of this update and the schedule's next state (a schedule counts its updates)."""
    if not callable(lr):
        return float(lr), state
    return rate_at(lr, state.count, where), ScaleByScheduleState(state.count + 1)


def _like_params(grads: Updates, params: Params) -> Updates:
    """The gradients in the parameters' dtype, for torch's kernels (which take one dtype): a
    bf16 gradient of a float32 parameter widens exactly, as ``update``'s arithmetic does."""
    if all(grads[u].dtype == t.dtype for u, t in params.shards.items()):
        return grads
    return grads.replace({u: grads[u].to(t.dtype) for u, t in params.shards.items()})


def _flipped(maximize: bool) -> list[GradientTransformation]:
    return [scale(-1.0)] if maximize else []


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    weight_decay_mask: DecayMask | None = None,
    maximize: bool = False,
    foreach: bool | None = None,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """AdamW with ``torch.optim.AdamW``'s numerics and defaults (optax's ``adamw``, torch's decay).

    ``chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))``;
    ``weight_decay`` defaults to torch's ``1e-2`` (optax's ``adamw`` has ``1e-4``).
    State: the chain's, two moments the size of the shards and one step count per
    parameter. In a train step it runs as torch's own kernel, in place on the donated
    shards and moments: no memory beyond the kernel's, no communication.

    Args:
        lr: a number, or a schedule ``lr(count) -> number`` of the updates applied before
            this one (0 at the first; a step ``apply_if_finite`` rejected or ``accumulate``
            deferred does not count), as ``torch.optim.lr_scheduler.LambdaLR`` stepped after
            each step gives ``base_lr * lr_lambda(k)``; any callable returning a number
            (``optax.linear_schedule``).
        betas: the moments' decay rates ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the second moment's square root, ``>= 0``.
        weight_decay: decoupled weight decay, ``>= 0``.
        weight_decay_mask: ``weight_decay_mask(name, shape) -> bool``: which parameters
            weight decay applies to (default all), as torch's parameter groups with
            ``weight_decay=0`` for the others (``lambda name, shape: len(shape) >= 2`` leaves
            biases and norms undecayed).
        maximize: ascend the loss instead of descending it, as torch's ``maximize``.
        foreach: torch's ``foreach`` kernel choice (``None``: torch's default).
        mu_dtype: the first moment's dtype (optax's ``mu_dtype``); ``None``: the
            parameters'. Gradients may have another dtype than the parameters (bf16
            gradients of float32 parameters): the arithmetic runs in the wider one, as
            optax's (``scale_by_adam``). With a ``mu_dtype`` other than the parameters', a
            train step runs ``update`` (torch's kernel takes one dtype).

    Returns:
        A ``GradientTransformation`` named ``"adamw"`` with a ``fused`` form.

    Raises:
        TypeError: if ``lr`` is neither a number nor a callable; at a step, if the
            schedule returns something that is not a number.
        ValueError: if ``lr``, ``eps`` or ``weight_decay`` is negative or a beta is not
            in ``[0, 1)``; at a step, if the schedule gives a learning rate that
            is not a finite number >= 0 (nothing is applied).

    Examples:
        >>> opt = adamw(lr=1e-3)
        >>> opt.name, opt.needs_whole_gradient
        ('adamw', False)
    """
    check_rate(lr, "adamw")
    if (not callable(lr) and lr < 0) or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(
            f"invalid AdamW hyper-parameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
        )
    tx = chain(
        *_flipped(maximize),
        scale_by_adam(betas[0], betas[1], eps, mu_dtype),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(lr),
    )

    def fused(grads: Updates, state: tuple[Any, ...], params: Params) -> tuple[Any, ...]:
        moments: ScaleByAdamState = state[-3]
        if any(moments.mu[u].dtype != t.dtype for u, t in params.shards.items()):
            return update_in_place(tx, grads, state, params)  # type: ignore[no-any-return]  # (the chain: torch's kernel takes one dtype)
        grads = _like_params(grads, params)
        rate, schedule = _rate(lr, state[-1], "adamw")
        todo = _select(grads, params, [moments.mu, moments.nu], moments.count, weight_decay_mask)
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
        _sync_counts(todo.whole, moments.count)
        return (*state[:-1], schedule)

    return tx._replace(name="adamw", fused=fused)


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    weight_decay_mask: DecayMask | None = None,
    maximize: bool = False,
    foreach: bool | None = None,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Adam with ``torch.optim.Adam``'s numerics: ``weight_decay`` is L2, added before the moments.

    ``chain(add_decayed_weights(wd), scale_by_adam(), scale_by_learning_rate(lr))``
    (optax's ``adam`` has no decay). State: two moments the size of the shards and one
    step count per parameter. In a train step it runs as torch's own kernel, in place on
    the donated shards and moments: no memory beyond the kernel's, no communication.

    Args:
        lr: a number or a schedule ``lr(count) -> number``, as in ``adamw``.
        betas: the moments' decay rates ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the second moment's square root, ``>= 0``.
        weight_decay: L2 penalty added to the gradient, ``>= 0``.
        weight_decay_mask: which parameters weight decay applies to, as in ``adamw``.
        maximize: ascend the loss instead of descending it, as torch's ``maximize``.
        foreach: torch's ``foreach`` kernel choice (``None``: torch's default).
        mu_dtype: the first moment's dtype, and gradients of another dtype, as in ``adamw``.

    Returns:
        A ``GradientTransformation`` named ``"adam"`` with a ``fused`` form.

    Raises:
        TypeError: if ``lr`` is neither a number nor a callable; at a step, if the
            schedule returns something that is not a number.
        ValueError: if ``lr``, ``eps`` or ``weight_decay`` is negative or a beta is not
            in ``[0, 1)``; at a step, if the schedule gives a learning rate that
            is not a finite number >= 0 (nothing is applied).

    Examples:
        >>> adam().name
        'adam'
    """
    check_rate(lr, "adam")
    if (not callable(lr) and lr < 0) or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(
            f"invalid Adam hyper-parameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
        )
    tx = chain(
        *_flipped(maximize),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_adam(betas[0], betas[1], eps, mu_dtype),
        scale_by_learning_rate(lr),
    )

    def fused(grads: Updates, state: tuple[Any, ...], params: Params) -> tuple[Any, ...]:
        moments: ScaleByAdamState = state[-2]
        if any(moments.mu[u].dtype != t.dtype for u, t in params.shards.items()):
            return update_in_place(tx, grads, state, params)  # type: ignore[no-any-return]  # (the chain: torch's kernel takes one dtype)
        grads = _like_params(grads, params)
        rate, schedule = _rate(lr, state[-1], "adam")
        todo = _select(grads, params, [moments.mu, moments.nu], moments.count, weight_decay_mask)
        for decayed, part in _by_decay(todo):
            _adam_kernel(
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
        _sync_counts(todo.whole, moments.count)
        return (*state[:-1], schedule)

    return tx._replace(name="adam", fused=fused)


def sgd(
    lr: LearningRate = 1e-2,
    momentum: float | None = None,
    *,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    weight_decay_mask: DecayMask | None = None,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
) -> GradientTransformation:
    """SGD (with optional momentum) with ``torch.optim.SGD``'s numerics.

    ``chain(add_decayed_weights(wd), trace(momentum), scale_by_learning_rate(lr))`` (the
    decay is L2, before the momentum; optax's ``sgd`` has none). As optax's, the chain's
    structure depends on whether ``momentum`` is given, never on its value: with
    ``momentum=None`` there is no ``trace`` and no state (torch's ``momentum=0``); with a
    number, 0 included, a momentum buffer per shard, so ``inject_hyperparams`` may set
    momentum to 0 or schedule it from 0. In a train step it runs as torch's own kernel, in
    place on the donated shards and buffers: no communication.

    Args:
        lr: a number or a schedule ``lr(count) -> number``, as in ``adamw``.
        momentum: the momentum factor, ``>= 0``; ``None`` (the default): plain SGD, no
            state.
        dampening: dampening of the momentum, as torch's.
        weight_decay: L2 penalty added to the gradient, ``>= 0``.
        weight_decay_mask: which parameters weight decay applies to, as in ``adamw``.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        maximize: ascend the loss instead of descending it, as torch's ``maximize``.
        foreach: torch's ``foreach`` kernel choice (``None``: torch's default).

    Returns:
        A ``GradientTransformation`` named ``"sgd"`` with a ``fused`` form.

    Raises:
        TypeError: if ``lr`` is neither a number nor a callable; at a step, if the
            schedule returns something that is not a number.
        ValueError: if ``lr``, ``momentum`` or ``weight_decay`` is negative, or
            ``nesterov`` is asked without ``momentum > 0`` and ``dampening == 0``; at a
            step, if the schedule gives a learning rate that is not a finite number >= 0
            (nothing is applied).

    Examples:
        >>> sgd(lr=0.1, momentum=0.9).name
        'sgd'
    """
    check_rate(lr, "sgd")
    if (not callable(lr) and lr < 0) or (momentum is not None and momentum < 0) or weight_decay < 0:
        raise ValueError(f"invalid SGD hyper-parameters lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
    if nesterov and (momentum is None or momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")
    tx = chain(
        *_flipped(maximize),
        add_decayed_weights(weight_decay, weight_decay_mask),
        *([trace(momentum, nesterov, dampening=dampening)] if momentum is not None else []),
        scale_by_learning_rate(lr),
    )

    def fused(grads: Updates, state: tuple[Any, ...], params: Params) -> tuple[Any, ...]:
        moments: TraceState | None = state[-2] if momentum is not None else None
        grads = _like_params(grads, params)
        rate, schedule = _rate(lr, state[-1], "sgd")
        states = [moments.trace] if moments is not None else []
        todo = _select(grads, params, states, moments.count if moments is not None else None, weight_decay_mask)
        for decayed, part in _by_decay(todo):
            mine = part.states[0] if states else []
            # torch starts a momentum buffer as a copy of the first gradient: a parameter
            # seen for the first time gets None, and the kernel's new buffer is copied back.
            buffers: list[torch.Tensor | None] = [None] * len(part.params)
            for k, (count, buffer) in enumerate(zip(part.steps, mine, strict=False)):
                buffers[k] = None if int(count.item()) == 0 else buffer
            if not momentum:  # torch's kernel keeps no buffer at 0; trace(0)'s is the gradient (torch's d_p)
                for buffer, g, p in zip(mine, part.grads, part.params, strict=False):
                    d_p = -g if maximize else g
                    buffer.copy_(d_p + p * weight_decay if decayed and weight_decay else d_p)
            _sgd_kernel(
                part.params,
                part.grads,
                buffers,
                foreach=foreach,
                weight_decay=weight_decay if decayed else 0.0,
                momentum=momentum or 0.0,
                lr=rate,
                dampening=dampening,
                nesterov=nesterov,
                maximize=maximize,
            )
            for target, used in zip(mine, buffers, strict=False):
                if used is not None and used is not target:
                    target.copy_(used)
            if moments is not None:
                for s in part.steps:
                    s.add_(1)
        _sync_counts(todo.whole, moments.count if moments is not None else None)
        return (*state[:-1], schedule)

    return tx._replace(name="sgd", fused=fused)


def lion(
    lr: LearningRate = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 1e-3,
    *,
    weight_decay_mask: DecayMask | None = None,
) -> GradientTransformation:
    """Lion (Chen et al. 2023), optax's ``lion`` with optax's defaults (torch has no Lion).

    ``chain(scale_by_lion(b1, b2), add_decayed_weights(wd), scale_by_learning_rate(lr))``.
    State: one moment the size of the shards; in a train step it runs as ``update`` (new
    moment and update tensors, copied into the donated ones). No communication.

    Args:
        lr: a number or a schedule ``lr(count) -> number``, as in ``adamw``.
        betas: ``(b1, b2)``: the rate of the update's interpolation and of the moment's
            decay, each in ``[0, 1]``.
        weight_decay: decoupled weight decay, ``>= 0``.
        weight_decay_mask: which parameters weight decay applies to, as in ``adamw``.

    Returns:
        A ``GradientTransformation`` named ``"lion"``.

    Raises:
        TypeError: if ``lr`` is neither a number nor a callable; at a step, if the
            schedule returns something that is not a number.
        ValueError: if ``weight_decay`` is negative or a beta is not in ``[0, 1]``; at a
            step, if the schedule gives a learning rate that is not a finite number >= 0
            (nothing is applied).

    Examples:
        >>> lion().name
        'lion'
    """
    check_rate(lr, "lion")
    if weight_decay < 0 or not all(0 <= b <= 1 for b in betas):
        raise ValueError(f"invalid Lion hyper-parameters betas={betas}, weight_decay={weight_decay}")
    tx = chain(
        scale_by_lion(betas[0], betas[1]),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(lr),
    )
    return tx._replace(name="lion")


def from_torch(optimizer: torch.optim.Optimizer) -> GradientTransformation:
    """Use any ``torch.optim`` optimizer built on the shard tensors (``list(params.values())``).

    Its state lives in the optimizer object, which each step changes: it runs in place only
    (its ``fused`` form; ``train_step`` with ``donate=True``), and its ``update`` refuses. It
    sees one tensor per unit, so it skips whole units: a unit none of whose parameters got
    a gradient is skipped (its ``.grad`` is ``None``); a unit where only some did raises,
    naming them (``adamw``/``sgd`` skip per parameter). Memory: the optimizer's own state
    (shard-sized, since it holds the shards); communication: none.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose parameters are the sharded
            parameters' shards.

    Returns:
        A ``GradientTransformation`` whose state is ``optimizer`` itself.

    Raises:
        TypeError: if ``optimizer`` is not a ``torch.optim.Optimizer``; from ``update``,
            always (it has no functional form).
        ValueError: from ``init``, if the optimizer holds tensors other than the shards;
            from ``init`` or a step, if it misses a unit's shard; from a step, if a unit got
            a gradient for only some of its parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"from_torch wants a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = f"from_torch({type(optimizer).__name__})"

    def _check(params: Sharded, whole: bool) -> list[torch.Tensor]:
        shards = tree_leaves(params)
        theirs = [p for g in optimizer.param_groups for p in g["params"]]
        ids = {id(p) for p in theirs}
        foreign = [tuple(p.shape) for p in theirs if id(p) not in {id(t) for t in shards}]
        missing = [unit for unit, t in params.shards.items() if id(t) not in ids]
        if foreign and (whole or missing):
            raise ValueError(
                f"the torch optimizer holds {len(theirs)} tensors, {len(foreign)} of them not this "
                f"state's shards (shapes {foreign[:4]}): it was built on other tensors (the module's "
                "unsharded parameters?); build it on list(params.values()) of the sharded params"
            )
        if missing:
            units = ", ".join(unit_label(u) for u in missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise ValueError(
                f"the torch optimizer holds {len(shards) - len(missing)} of this state's {len(shards)} shards: it "
                f"misses those of unit{'s' if len(missing) > 1 else ''} {units}, which would never be stepped; "
                "build it on list(params.values()) of the sharded params (a unit to keep fixed: freeze its "
                "parameters before make_plan)"
            )
        return shards

    def init(params: Sharded) -> torch.optim.Optimizer:
        _check(params, whole=True)
        return optimizer

    def update(
        grads: Updates, state: torch.optim.Optimizer, params: Params | None = None
    ) -> tuple[Updates, torch.optim.Optimizer]:
        raise TypeError(
            f"{name} keeps its state inside the torch optimizer, which a step changes in place: it has no "
            "functional update; run it in train_step (donate=True) or ff.update_in_place, or use ff.adamw / ff.sgd"
        )

    def fused(grads: Updates, state: torch.optim.Optimizer, params: Params) -> torch.optim.Optimizer:
        _check(params, whole=False)
        stepped = []
        for unit in params.plan.units:
            mask = grads.mask(unit)
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
        return state

    return GradientTransformation(init, update, name, needs_whole_gradient=False, fused=fused)
