"""Building blocks: gradient transformations over sharded pytrees, as optax's.

Each is a ``GradientTransformation`` (``_base.py``): ``update`` returns new updates and
state and changes nothing it is given. They run on this rank's shards, unit by unit;
a parameter that got no gradient (``grads.received``) keeps its state and gets a zero
update. What needs every rank (a global norm) does one all-reduce of one number over the
shard group (and one over the replicas with hybrid sharding); nothing else communicates.

Optimizers are chains of these (``_optim.py``): ``adamw`` is
``chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))``, as in optax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsdp_fn._base import (
    EmptyState,
    GradientTransformation,
    Params,
    Updates,
    element_mask,
    map_units,
    per_element,
    received_units,
)
from fsdp_fn._collectives import all_reduce_, all_reduce_over_
from fsdp_fn._norms import max_abs, power_sum
from fsdp_fn._plan import Unit
from fsdp_fn._shard import Layout, Sharded
from fsdp_fn._tp import all_reduce_max

__all__ = [
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "clip",
    "clip_by_global_norm",
    "global_norm",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_schedule",
    "set_to_zero",
    "trace",
    "zero_nans",
]

Schedule = Callable[[int], Any]  # the count of updates applied before this one -> a number
ScalarOrSchedule = float | Schedule
ParamMask = Callable[[str, tuple[int, ...]], bool]  # (name, shape) -> whether a link applies to the parameter


def _empty(params: Params) -> EmptyState:
    return EmptyState()


def _stateless(
    name: str, fn: Callable[[torch.Tensor], torch.Tensor], fn_: Callable[[torch.Tensor], torch.Tensor]
) -> GradientTransformation:
    """A transformation that maps each received unit's gradient by ``fn`` and keeps no state;
    ``fn_`` does it in place (zero stays zero), for donated gradients."""

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        updates, _ = map_units(lambda unit, mask, g: (fn(g),), grads, [])
        return updates, state

    def update_donated(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        for unit in received_units(grads):
            fn_(grads[unit.name])
        return grads, state

    return GradientTransformation(
        _empty, update, name, needs_whole_gradient=False, update_donated=update_donated, fresh_updates=True
    )


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by ``step_size`` (optax's ``scale``).

    Memory: one new tensor per updated unit (none in place, on the step's donated
    gradients); no communication.

    Args:
        step_size: the factor.

    Returns:
        A stateless ``GradientTransformation`` (state ``EmptyState()``) that works unit by
        unit, so it may run during backward.

    Raises:
        TypeError: if ``step_size`` is not a number.

    Examples:
        >>> scale(0.5).needs_whole_gradient
        False
    """
    _check_number(step_size, "scale(step_size)")
    return _stateless(f"scale({step_size:g})", lambda g: g * step_size, lambda g: g.mul_(step_size))


def clip(max_delta: float) -> GradientTransformation:
    """Clip each element of the updates to ``[-max_delta, max_delta]`` (optax's ``clip``).

    Memory: one new tensor per updated unit (none in place, on the step's donated
    gradients); no communication.

    Args:
        max_delta: the largest magnitude an element keeps, ``>= 0``.

    Returns:
        A stateless ``GradientTransformation`` (state ``EmptyState()``) that works unit by
        unit, so it may run during backward.

    Raises:
        TypeError: if ``max_delta`` is not a number.
        ValueError: if ``max_delta`` is negative.

    Examples:
        >>> clip(1.0).name
        'clip(1)'
    """
    if not (_check_number(max_delta, "clip(max_delta)") >= 0):
        raise ValueError(f"clip: max_delta must be >= 0, got {max_delta!r}")
    return _stateless(
        f"clip({max_delta:g})", lambda g: g.clamp(-max_delta, max_delta), lambda g: g.clamp_(-max_delta, max_delta)
    )


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by zeros (optax's ``zero_nans``, without its ``found_nan`` flags).

    Without optax's per-leaf flags: a rank sees only its shards, so the flags would differ
    between ranks; ``apply_if_finite`` makes the global decision. Infinities are kept.
    Memory: one new tensor per updated unit (none in place); no communication.

    Returns:
        A stateless ``GradientTransformation`` (state ``EmptyState()``) that works unit by
        unit, so it may run during backward.

    Examples:
        >>> zero_nans().name
        'zero_nans'
    """
    return _stateless(
        "zero_nans",
        lambda g: torch.nan_to_num(g, nan=0.0, posinf=math.inf, neginf=-math.inf),
        lambda g: g.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf),
    )


def set_to_zero() -> GradientTransformation:
    """Replace the updates by zeros (optax's ``set_to_zero``): how to freeze parameters.

    ``multi_transform({"train": ff.adamw(), "frozen": ff.set_to_zero()}, labels)``. An inf or
    NaN gradient gives a zero update too, so the parameter keeps its value (``scale(0.0)``
    gives ``0 * inf = nan``). Memory: one new tensor per updated unit (none in place, on the
    step's donated gradients); no communication.

    Returns:
        A stateless ``GradientTransformation`` (state ``EmptyState()``) that works unit by
        unit, so it may run during backward.

    Examples:
        >>> set_to_zero().name
        'set_to_zero'
    """
    return _stateless("set_to_zero", torch.zeros_like, lambda g: g.zero_())


# --- the global norm --------------------------------------------------------------------


def check_norm_type(norm_type: Any, where: str) -> float:
    """``norm_type`` as a float: a number ``> 0`` or ``math.inf`` (torch's ``clip_grad_norm_`` takes any ``p``)."""
    p = _check_number(norm_type, where)
    if not p > 0:  # (NaN fails too)
        raise ValueError(f"{where} must be a number > 0 or math.inf (1, 2, inf, ...), got {norm_type!r}")
    return p


def _received_parts(grads: Sharded, unit: Unit) -> list[torch.Tensor]:
    """This rank's elements of ``unit`` that belong to the parameters ``grads`` marks as received:
    the whole shard (padding is zero), or one slice (a view) per received parameter of a unit
    only some of whose parameters are (``masked``, one label of ``multi_transform``): the
    others' elements are absent, so no norm counts them, NaN or not."""
    return grads.layout.counted_parts(unit, grads[unit.name].reshape(-1), grads.mask(unit))


def global_norm(grads: Sharded, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of the whole (unsharded) tree, as a 0-d float64 tensor, the same on every rank.

    Only the parameters ``grads`` marks as received count (in a unit only some of whose
    parameters are, the others' elements are absent: what ``masked`` and one label of
    ``multi_transform`` give their inner transformation). A p-norm: the sums of ``|x|**p``
    of this rank's pieces (``square_norm`` for ``p == 2``: exact at any size; padding is
    zero), all-reduced over the group, averaged over the replicas (which hold the same
    shards: counted once), summed over a tensor-parallel axis (each of its ranks counts the
    parameters it splits, its first one the rest), then ``**(1/p)``. ``math.inf``: the largest ``|x|``; the ranks'
    maxima are all-reduced as a vector of ``W`` numbers, each rank's at its index (the
    replicas hold the same maxima: no replica all-reduce); a NaN anywhere gives NaN.
    Communication: one all-reduce of one number (two with replicas); of ``W`` numbers for
    ``math.inf``. Every rank of the group must call it.

    Args:
        grads: sharded gradients or updates; units none of whose parameters got a
            gradient count for nothing.
        norm_type: ``p`` of the p-norm, a number ``> 0`` or ``math.inf`` (torch's
            ``clip_grad_norm_(norm_type=)``).

    Returns:
        The global norm, a 0-d float64 tensor on the CPU.

    Raises:
        TypeError: if ``norm_type`` is not a number.
        ValueError: if ``norm_type`` is not ``> 0``.

    Examples:
        >>> check_norm_type(math.inf, "global_norm(norm_type)")
        inf
    """
    p = check_norm_type(norm_type, "global_norm(norm_type)")
    layout = grads.layout
    parts = [x for unit in received_units(grads) for x in _received_parts(grads, unit)]
    if p == math.inf:
        each = torch.zeros(layout.world, dtype=torch.float64)
        if parts:
            each[layout.rank] = torch.stack([max_abs(x).cpu() for x in parts]).amax()
        top = all_reduce_(each, layout.group).amax()
        return all_reduce_max(top, layout.tensor_axis.group) if layout.tensor_axis is not None else top
    total = torch.zeros((), dtype=torch.float64)
    for x in parts:
        total += power_sum(x, p).cpu()
    all_reduce_(total, layout.group)
    if layout.tensor_axis is not None:  # (each rank of it counts the parameters it splits, its first the rest)
        all_reduce_(total, layout.tensor_axis.group)
    if layout.replicas > 1:
        all_reduce_over_(total, layout.replica_groups).div_(layout.replicas)
    return total.sqrt() if p == 2 else total.pow(1 / p)


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0) -> GradientTransformation:
    """Scale the updates so their global norm is at most ``max_norm`` (torch's ``clip_grad_norm_`` rule).

    ``coef = min(1, max_norm / (norm + 1e-6))`` (optax's scales by ``max_norm / norm``
    only above it: the same but for that 1e-6), ``norm`` the ``norm_type``-norm
    (``global_norm``) of the updates it receives, whatever came before it in a chain; inside
    ``masked`` or one label of ``multi_transform``, of the selected parameters only.
    Communication: ``global_norm``'s (one all-reduce of one number; of ``W`` numbers for
    ``math.inf``); memory: one new tensor per updated unit (none in place, on the step's
    donated gradients).

    Args:
        max_norm: the largest global norm, a positive finite number.
        norm_type: ``p`` of the norm, a number ``> 0`` or ``math.inf``, as torch's
            ``clip_grad_norm_(norm_type=)`` (optax's is the 2-norm).

    Returns:
        A stateless ``GradientTransformation`` that needs the whole gradient (it cannot run
        during backward).

    Raises:
        TypeError: if ``max_norm`` or ``norm_type`` is not a number.
        ValueError: if ``max_norm`` is not a positive finite number or ``norm_type`` is not
            ``> 0``.

    Examples:
        >>> clip_by_global_norm(1.0).needs_whole_gradient
        True
        >>> clip_by_global_norm(1.0, norm_type=math.inf).name
        'clip_by_global_norm(1, norm_type=inf)'
    """
    if not (_check_number(max_norm, "clip_by_global_norm(max_norm)") > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive finite number, got {max_norm!r}")
    p = check_norm_type(norm_type, "clip_by_global_norm(norm_type)")

    def coefficient(grads: Updates) -> torch.Tensor:
        return torch.clamp(max_norm / (global_norm(grads, p).float() + 1e-6), max=1.0)

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        coef = coefficient(grads)
        updates, _ = map_units(lambda unit, mask, g: (g * coef.to(g.device),), grads, [])
        return updates, state

    def update_donated(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        coef = coefficient(grads)
        for unit in received_units(grads):
            for x in _received_parts(grads, unit):  # (views: the other parameters' elements stay as they are)
                x.mul_(coef.to(x.device))
        return grads, state

    name = f"clip_by_global_norm({max_norm:g})" if p == 2 else f"clip_by_global_norm({max_norm:g}, norm_type={p:g})"
    return GradientTransformation(
        _empty,
        update,
        name,
        global_norms=int(p != math.inf),
        max_norms=int(p == math.inf),
        update_donated=update_donated,
        fresh_updates=True,
    )


# --- weight decay and learning rates ----------------------------------------------------


def _check_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def check_rate(lr: ScalarOrSchedule, where: str) -> None:
    """Refuse, by its type, a learning rate that is neither a number nor a callable schedule."""
    if callable(lr):
        return
    if isinstance(lr, bool) or not isinstance(lr, int | float):
        raise TypeError(
            f"{where}: lr must be a number or a schedule (a callable count -> number, e.g. "
            f"optax.linear_schedule(...)), got {type(lr).__name__} {lr!r}"
        )


def rate_at(lr: ScalarOrSchedule, count: int, where: str) -> float:
    """``lr``, or the schedule's value ``lr(count)`` as a Python float.

    A schedule may return a Python number or a 0-d tensor or array (torch, numpy, jax:
    anything ``float()`` takes); any other type is refused naming it, a value that is not a
    finite number >= 0 naming it and the count."""
    if not callable(lr):
        return float(lr)
    value = lr(count)
    try:
        if isinstance(value, bool | str):
            raise TypeError
        rate = float(value)
    except (TypeError, ValueError, RuntimeError):
        shape = getattr(value, "shape", None)
        raise TypeError(
            f"{where}: the schedule returned a {type(value).__name__}"
            + (f" of shape {tuple(shape)}" if shape is not None else "")
            + f" at count {count}; a learning rate is a number: a Python float or a 0-d tensor or array "
            "(torch, numpy, jax)"
        ) from None
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(
            f"{where}: the schedule gave lr={rate!r} at count {count}; a learning rate must be a finite number >= 0 "
            "(nothing was applied)"
        )
    return rate


class _Masks:
    """Which parameters of each unit a ``ParamMask`` selects, and the element masks of the
    units it splits (made once per unit and layout).

    Keyed by the unit itself (its name, parameters' names, shapes and dtypes), never by its
    name alone: one transformation value may serve several parameter trees, as optax's."""

    def __init__(self, select: ParamMask | None) -> None:
        self.select = select
        self._elements: dict[tuple[Unit, int, int, torch.device], torch.Tensor | None] = {}

    def of(self, unit: Unit) -> tuple[bool, ...]:
        if self.select is None:
            return (True,) * len(unit.params)
        return tuple(bool(self.select(spec.name, spec.shape)) for spec in unit.params)

    def elements(self, unit: Unit, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """``None`` where the mask takes every parameter of ``unit``, else its element mask."""
        key = (unit, layout.world, layout.rank, device)
        if key not in self._elements:
            mask = self.of(unit)
            self._elements[key] = None if all(mask) else element_mask(unit, mask, layout, device)
        return self._elements[key]


def add_decayed_weights(weight_decay: float = 0.0, mask: ParamMask | None = None) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (optax's ``add_decayed_weights``).

    Memory: one new tensor per updated unit (none in place, on donated updates); no
    communication.

    Args:
        weight_decay: the factor, ``>= 0`` (0: the updates pass unchanged).
        mask: ``mask(name, shape) -> bool``: the parameters it applies to (default all), as
            torch's parameter groups with ``weight_decay=0`` for the others.

    Returns:
        A stateless ``GradientTransformation`` (state ``EmptyState()``) that works unit by
        unit, so it may run during backward. Its ``update`` needs ``params`` unless
        ``weight_decay`` is 0.

    Raises:
        TypeError: if ``weight_decay`` is not a number.
        ValueError: if ``weight_decay`` is negative; from ``update``, if it is given no
            ``params`` and ``weight_decay`` is not 0.

    Examples:
        >>> add_decayed_weights(0.1).name
        'add_decayed_weights(0.1)'
    """
    if not (_check_number(weight_decay, "add_decayed_weights(weight_decay)") >= 0):
        raise ValueError(f"add_decayed_weights: weight_decay must be >= 0, got {weight_decay!r}")
    masks = _Masks(mask)

    def decayed(grads: Updates, params: Params | None, in_place: bool) -> Updates:
        if weight_decay == 0:  # reads no parameter, so needs none (adam's and sgd's default)
            return grads
        if params is None:
            raise ValueError("add_decayed_weights needs params: update(grads, state, params)")

        def decay(unit: Unit, got: tuple[bool, ...], g: torch.Tensor) -> tuple[torch.Tensor]:
            p = params[unit.name]
            where = masks.elements(unit, grads.layout, g.device)
            # torch.optim.SGD's arithmetic (``grad.add(param, alpha=weight_decay)``)
            if where is None:
                same = in_place and all(got) and g.dtype == torch.promote_types(g.dtype, p.dtype)
                return (g.add_(p, alpha=weight_decay) if same else torch.add(g, p, alpha=weight_decay),)
            return (torch.where(where, torch.add(g, p, alpha=weight_decay), g),)

        return map_units(decay, grads, [])[0]

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        return decayed(grads, params, in_place=False), state

    def update_donated(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        return decayed(grads, params, in_place=True), state

    return GradientTransformation(
        _empty,
        update,
        f"add_decayed_weights({weight_decay:g})",
        needs_whole_gradient=False,
        update_donated=update_donated,
        fresh_updates=True,
    )


class ScaleByScheduleState(NamedTuple):
    """The state of ``scale_by_schedule`` and of a scheduled ``scale_by_learning_rate``.

    Attributes:
        count: the updates applied before the next one: what the schedule reads.
    """

    # updates applied before the next one: what the schedule reads (optax's name: it shadows tuple.count)
    count: int  # type: ignore[assignment]


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)`` (optax's ``scale_by_schedule``).

    ``count`` is the number of updates this transformation applied before; a rejected or
    deferred step (``apply_if_finite``, ``accumulate`` around it) does not count. Memory:
    one new tensor per updated unit; no communication.

    Args:
        step_size_fn: ``step_size_fn(count) -> number`` (a Python number or a 0-d tensor
            or array).

    Returns:
        A ``GradientTransformation`` whose state is ``ScaleByScheduleState(count)``.

    Raises:
        TypeError: if ``step_size_fn`` is not callable; from ``update``, if it returns
            something that is not a number.

    Examples:
        >>> scale_by_schedule(lambda k: 0.5 ** k).init(None)
        ScaleByScheduleState(count=0)
    """
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule takes a callable count -> number, got {type(step_size_fn).__name__}")

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(0)

    def factor_at(count: int) -> float:
        value = step_size_fn(count)
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"scale_by_schedule: the schedule returned a {type(value).__name__} at count {count}, not a number"
            ) from None

    def update(
        grads: Updates, state: ScaleByScheduleState, params: Params | None = None
    ) -> tuple[Updates, ScaleByScheduleState]:
        factor = factor_at(state.count)
        updates, _ = map_units(lambda unit, mask, g: (g * factor,), grads, [])
        return updates, ScaleByScheduleState(state.count + 1)

    def update_donated(
        grads: Updates, state: ScaleByScheduleState, params: Params | None = None
    ) -> tuple[Updates, ScaleByScheduleState]:
        return _scaled_(grads, factor_at(state.count)), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(
        init, update, "scale_by_schedule", needs_whole_gradient=False, update_donated=update_donated, fresh_updates=True
    )


def scale_by_learning_rate(lr: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply the updates by ``-lr`` (``lr`` with ``flip_sign=False``), as optax's.

    Memory: one new tensor per updated unit; no communication.

    Args:
        lr: a number, or a schedule ``lr(count)`` of the updates applied before this one (0
            at the first), which the state counts: ``ScaleByScheduleState(count)``. Any
            callable returning a number works: a Python function,
            ``optax.linear_schedule(...)`` (a jax scalar), a 0-d tensor. torch's
            ``LambdaLR(opt, f)`` stepped after each step is ``lr=lambda k: base_lr * f(k)``.
        flip_sign: multiply by ``-lr`` (descent); ``False``: by ``lr``.

    Returns:
        A ``GradientTransformation``: with a number, a stateless ``scale``; with a
        schedule, one whose state is ``ScaleByScheduleState(count)``.

    Raises:
        TypeError: if ``lr`` is neither a number nor a callable; from ``update``, if the
            schedule returns something that is not a number.
        ValueError: if a number ``lr`` is not finite and ``>= 0``; from ``update``, if the
            schedule gives a learning rate that is not a finite number >= 0.

    Examples:
        >>> scale_by_learning_rate(lambda k: 1e-3 * 0.9 ** k).init(None)
        ScaleByScheduleState(count=0)
    """
    check_rate(lr, "scale_by_learning_rate")
    if not callable(lr) and not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"scale_by_learning_rate: lr must be a finite number >= 0, got {lr!r}")
    sign = -1.0 if flip_sign else 1.0
    if not callable(lr):
        return scale(sign * float(lr))._replace(name=f"scale_by_learning_rate({lr:g})")

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(0)

    def update(
        grads: Updates, state: ScaleByScheduleState, params: Params | None = None
    ) -> tuple[Updates, ScaleByScheduleState]:
        rate = sign * rate_at(lr, state.count, "scale_by_learning_rate")
        updates, _ = map_units(lambda unit, mask, g: (g * rate,), grads, [])
        return updates, ScaleByScheduleState(state.count + 1)

    def update_donated(
        grads: Updates, state: ScaleByScheduleState, params: Params | None = None
    ) -> tuple[Updates, ScaleByScheduleState]:
        rate = sign * rate_at(lr, state.count, "scale_by_learning_rate")
        return _scaled_(grads, rate), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(
        init,
        update,
        "scale_by_learning_rate(schedule)",
        needs_whole_gradient=False,
        update_donated=update_donated,
        fresh_updates=True,
    )


def _scaled_(grads: Updates, factor: float) -> Updates:
    """``grads`` (donated) times ``factor``, in place (their elements no parameter received are zeros)."""
    for unit in received_units(grads):
        grads[unit.name].mul_(factor)
    return grads


# --- moments ----------------------------------------------------------------------------


def step_counts(params: Params) -> Sharded:
    """Per unit, one float32 count per trainable parameter (shape ``(P,)``): the updates it got.

    Per parameter, as torch.optim keeps ``state[p]["step"]`` (a parameter without a
    gradient does not count a step), and float32, its dtype there, so checkpoints keep
    torch's layout (``optim.state.<name>.step``)."""
    return params.replace(
        {
            u.name: torch.zeros(len(u.params), dtype=torch.float32, device=params[u.name].device)
            for u in params.plan.units
        }
    )


def zeros_like(params: Params, dtype: torch.dtype | None = None) -> Sharded:
    """Zeros shaped like each shard, in its dtype or ``dtype``."""
    return params.replace(
        {u: torch.zeros_like(t, dtype=dtype, memory_format=torch.contiguous_format) for u, t in params.shards.items()}
    )


def check_float_dtype(dtype: Any, where: str) -> None:
    """Refuse a dtype argument that is neither ``None`` nor a floating torch dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{where} must be a floating torch.dtype or None, got {dtype!r}")


def _counted(count: torch.Tensor, mask: tuple[bool, ...]) -> torch.Tensor:
    return count + torch.tensor(mask, dtype=count.dtype, device=count.device)


def _steps(unit: Unit, count: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The step counts to correct a unit's moments with: its one count, or one per element."""
    if len(count) and bool((count == count[0]).all()):
        return count[0]
    return per_element(unit, count, layout)


class ScaleByAdamState(NamedTuple):
    """The state of ``scale_by_adam`` (and of ``adamw``/``adam``), sharded like the parameters.

    Attributes:
        count: per unit, one float32 step count per trainable parameter (torch's
            ``"step"``).
        mu: the first moment (torch's ``"exp_avg"``).
        nu: the second moment (torch's ``"exp_avg_sq"``).
    """

    # per unit: one float32 step count per trainable parameter (torch's "step") (optax's name: it shadows tuple.count)
    count: Sharded  # type: ignore[assignment]
    mu: Sharded  # first moment (torch's "exp_avg")
    nu: Sharded  # second moment (torch's "exp_avg_sq")


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, mu_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Adam's direction ``mu_hat / (sqrt(nu_hat) + eps)`` (optax's ``scale_by_adam``), with torch's arithmetic.

    Per-parameter step counts (bias correction per parameter, as torch.optim's; optax
    keeps one count). Gradients may have another dtype than the parameters (bf16 gradients
    of float32 parameters), as optax's: the moments keep their dtype (``nu`` the
    parameters', ``mu`` ``mu_dtype``), the arithmetic runs in the wider of the gradient's
    and the moments' dtypes (torch's type promotion, as jax's), and the update has that
    dtype. Memory: two moments the size of the shards; no communication.

    Args:
        b1: the first moment's decay rate, in ``[0, 1)``.
        b2: the second moment's decay rate, in ``[0, 1)``.
        eps: added to the second moment's square root, ``>= 0``.
        mu_dtype: the first moment's dtype (optax's ``mu_dtype``); ``None``: the
            parameters'.

    Returns:
        A ``GradientTransformation`` whose state is ``ScaleByAdamState``.

    Raises:
        ValueError: if a decay rate is not in ``[0, 1)`` or ``eps`` is negative.
        TypeError: if ``mu_dtype`` is neither ``None`` nor a floating torch dtype.

    Examples:
        >>> scale_by_adam().needs_whole_gradient
        False
    """
    if not (0 <= b1 < 1 and 0 <= b2 < 1 and eps >= 0):
        raise ValueError(f"invalid Adam hyper-parameters betas=({b1}, {b2}), eps={eps}")
    check_float_dtype(mu_dtype, "scale_by_adam: mu_dtype")

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(step_counts(params), zeros_like(params, mu_dtype), zeros_like(params))

    def update(
        grads: Updates, state: ScaleByAdamState, params: Params | None = None
    ) -> tuple[Updates, ScaleByAdamState]:
        layout = grads.layout

        def adam(
            unit: Unit, mask: tuple[bool, ...], g: torch.Tensor, count: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            count = _counted(count, mask)
            wide = torch.promote_types(torch.promote_types(g.dtype, mu.dtype), nu.dtype)
            g = g.to(wide)
            m = mu.to(wide).lerp(g, 1 - b1)
            v = (nu.to(wide) * b2).addcmul_(g, g, value=1 - b2)
            steps = _steps(unit, count, layout)
            bias1, bias2 = 1 - b1**steps, 1 - b2**steps
            # torch's arithmetic, m / (sqrt(v) / sqrt(bias2) + eps) / bias1, in one new buffer
            out = v.sqrt().div_(bias2.sqrt()).add_(eps)
            return torch.div(m, out, out=out).div_(bias1), count, m.to(mu.dtype), v.to(nu.dtype)

        updates, (count, mu, nu) = map_units(adam, grads, [state.count, state.mu, state.nu])
        return updates, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update, "scale_by_adam", needs_whole_gradient=False, fresh_updates=True)


class TraceState(NamedTuple):
    """The state of ``trace`` (and of ``sgd`` with momentum), sharded like the parameters.

    Attributes:
        count: per unit, one float32 step count per trainable parameter.
        trace: the momentum buffer (torch's ``"momentum_buffer"``).
    """

    # per unit: one float32 step count per trainable parameter (optax's name: it shadows tuple.count)
    count: Sharded  # type: ignore[assignment]
    trace: Sharded  # the momentum buffer (torch's "momentum_buffer")


def trace(decay: float, nesterov: bool = False, *, dampening: float = 0.0) -> GradientTransformation:
    """Momentum as torch.optim.SGD has it: ``trace = decay * trace + (1 - dampening) * g``.

    Starting from the first gradient itself; the update is ``trace`` (``g + decay * trace``
    with ``nesterov``). Without dampening it is optax's ``trace``. Memory: one buffer the
    size of the shards; no communication.

    Args:
        decay: the momentum factor, ``>= 0``.
        nesterov: Nesterov momentum (needs ``decay > 0`` and no dampening).
        dampening: how much of the gradient is kept out of the buffer, in ``[0, 1]``.

    Returns:
        A ``GradientTransformation`` whose state is ``TraceState``.

    Raises:
        ValueError: if ``decay`` is negative, ``dampening`` is not in ``[0, 1]``, or
            ``nesterov`` is asked without ``decay > 0`` and ``dampening == 0``.

    Examples:
        >>> trace(0.9).name
        'trace(0.9)'
    """
    if decay < 0 or not 0 <= dampening <= 1:
        raise ValueError(f"invalid momentum {decay} / dampening {dampening}")
    if nesterov and (decay <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")

    def init(params: Params) -> TraceState:
        return TraceState(step_counts(params), zeros_like(params))

    def update(grads: Updates, state: TraceState, params: Params | None = None) -> tuple[Updates, TraceState]:
        layout = grads.layout

        def momentum(
            unit: Unit, mask: tuple[bool, ...], g: torch.Tensor, count: torch.Tensor, buf: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            new = buf * decay + g * (1 - dampening)
            if dampening != 0 and bool((count == 0).any()):  # torch: the first buffer is the gradient itself
                new = torch.where(per_element(unit, count, layout) == 0, g, new)
            update = g + new * decay if nesterov else new
            return update, _counted(count, mask), new

        updates, (count, buf) = map_units(momentum, grads, [state.count, state.trace])
        return updates, TraceState(count, buf)

    return GradientTransformation(init, update, f"trace({decay:g})", needs_whole_gradient=False)


class ScaleByLionState(NamedTuple):
    """The state of ``scale_by_lion`` (and of ``lion``), sharded like the parameters.

    Attributes:
        mu: the momentum (torch ports call it ``"exp_avg"``).
    """

    mu: Sharded  # the momentum (torch ports call it "exp_avg")


def _sign(x: torch.Tensor) -> torch.Tensor:
    """``sign(x)`` with NaN kept NaN, as ``jnp.sign`` (``torch.sign(nan)`` is 0)."""
    return torch.where(x.isnan(), x, x.sign())


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction ``sign((1 - b1) g + b1 mu)``, then ``mu = b2 mu + (1 - b2) g`` (optax's ``scale_by_lion``).

    The sign of NaN is NaN, as ``jnp.sign``'s (``torch.sign`` gives 0, which would leave the
    parameter still while its moment stays NaN): a NaN gradient makes a NaN update, which
    ``apply_if_finite`` sees. Memory: one moment the size of the shards; no communication.

    Args:
        b1: the rate of the direction's interpolation, in ``[0, 1]``.
        b2: the moment's decay rate, in ``[0, 1]``.

    Returns:
        A ``GradientTransformation`` whose state is ``ScaleByLionState``.

    Raises:
        ValueError: if ``b1`` or ``b2`` is not in ``[0, 1]``.

    Examples:
        >>> scale_by_lion().name
        'scale_by_lion'
    """
    if not (0 <= b1 <= 1 and 0 <= b2 <= 1):
        raise ValueError(f"invalid Lion hyper-parameters b1={b1}, b2={b2}")

    def init(params: Params) -> ScaleByLionState:
        return ScaleByLionState(zeros_like(params))

    def update(
        grads: Updates, state: ScaleByLionState, params: Params | None = None
    ) -> tuple[Updates, ScaleByLionState]:
        def lion(unit: Unit, mask: tuple[bool, ...], g: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return _sign(g * (1 - b1) + mu * b1), mu * b2 + g * (1 - b2)

        updates, (mu,) = map_units(lion, grads, [state.mu])
        return updates, ScaleByLionState(mu)

    return GradientTransformation(init, update, "scale_by_lion", needs_whole_gradient=False, fresh_updates=True)
