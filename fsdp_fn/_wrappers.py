"""Transformations that wrap others, as optax's: skip a non-finite step, accumulate over
calls, apply to some parameters, one transformation per label, hyper-parameters in the state.

Each wrapper keeps its counters in its state (plain Python numbers) beside its inner
state, and says what its last update did through ``outcome`` (``_base.Outcome``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from fsdp_fn._base import (
    GradientTransformation,
    Outcome,
    Params,
    Updates,
    _check,
    call_update,
    element_mask,
    no_update,
    update_in_place,
)
from fsdp_fn._collectives import all_reduce_over_
from fsdp_fn._plan import Unit
from fsdp_fn._shard import Sharded
from fsdp_fn._transforms import ParamMask, check_float_dtype, global_norm, zeros_like

__all__ = [
    "AccumulateState",
    "ApplyIfFiniteState",
    "InjectHyperparamsState",
    "MaskedState",
    "MultiTransformState",
    "accumulate",
    "apply_if_finite",
    "inject_hyperparams",
    "masked",
    "multi_transform",
]


def _nothing(grads: Updates) -> Updates:
    """Zero updates for every unit, marked as reaching no parameter."""
    layout = grads.layout
    return grads.replace({u.name: no_update(u, grads[u.name], layout) for u in grads.plan.units}).with_received({})


def _inner_outcome(inner: GradientTransformation, state: Any) -> Outcome:
    return inner.outcome(state) if inner.outcome is not None else Outcome.APPLIED


# --- apply_if_finite --------------------------------------------------------------------


class ApplyIfFiniteState(NamedTuple):
    """The state of ``apply_if_finite``: its counters (Python numbers) and ``inner``'s state.

    Attributes:
        notfinite_count: non-finite gradients in a row.
        last_finite: whether the last gradient was finite.
        total_notfinite: non-finite gradients in all.
        inner_state: the wrapped transformation's state.
    """

    notfinite_count: int  # non-finite gradients in a row
    last_finite: bool  # whether the last gradient was finite
    total_notfinite: int
    inner_state: Any


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int | None = None) -> GradientTransformation:
    """Apply ``inner`` only when the gradients' global norm is finite (optax's ``apply_if_finite``).

    Finite: no NaN or inf on any rank. Otherwise the updates are zero and ``inner``'s state
    stays as it was. In a train step a rejected update leaves everything as it was,
    buffers included. The decision is the same on every rank. Communication: one
    all-reduce of one number (two with replicas); memory: ``inner``'s.

    Args:
        inner: the transformation to guard.
        max_consecutive_errors: after more than this many non-finite gradients in a row
            the update is applied anyway, as optax does; ``None`` (the default) never
            applies one.

    Returns:
        A ``GradientTransformation`` whose state is ``ApplyIfFiniteState`` and whose
        ``outcome`` says ``REJECTED`` after a skipped update.

    Raises:
        TypeError: if ``inner`` is not a ``GradientTransformation``.
        ValueError: if ``max_consecutive_errors`` is neither ``None`` nor a whole number
            ``>= 0``.

    Examples:
        >>> from fsdp_fn import adamw
        >>> apply_if_finite(adamw(), max_consecutive_errors=5).outcome is not None
        True
    """
    inner = _check(inner, "apply_if_finite")
    if max_consecutive_errors is not None and (
        isinstance(max_consecutive_errors, bool)
        or not isinstance(max_consecutive_errors, int)
        or max_consecutive_errors < 0
    ):
        raise ValueError(
            "apply_if_finite: max_consecutive_errors must be a whole number >= 0 or None, "
            f"got {max_consecutive_errors!r}"
        )

    def init(params: Params) -> ApplyIfFiniteState:
        return ApplyIfFiniteState(0, True, 0, inner.init(params))

    def decide(grads: Updates, state: ApplyIfFiniteState) -> tuple[bool, int, bool]:
        finite = bool(torch.isfinite(global_norm(grads)))
        count = 0 if finite else state.notfinite_count + 1
        applies = finite or (max_consecutive_errors is not None and count > max_consecutive_errors)
        return finite, count, applies

    def new_state(state: ApplyIfFiniteState, finite: bool, count: int, inner_state: Any) -> ApplyIfFiniteState:
        return ApplyIfFiniteState(count, finite, state.total_notfinite + (not finite), inner_state)

    def update(
        grads: Updates, state: ApplyIfFiniteState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, ApplyIfFiniteState]:
        finite, count, applies = decide(grads, state)
        if not applies:
            return _nothing(grads), new_state(state, finite, count, state.inner_state)
        updates, inner_state = call_update(inner, grads, state.inner_state, params, extra)
        return updates, new_state(state, finite, count, inner_state)

    def fused(grads: Updates, state: ApplyIfFiniteState, params: Params) -> ApplyIfFiniteState:
        finite, count, applies = decide(grads, state)
        inner_state = update_in_place(inner, grads, state.inner_state, params) if applies else state.inner_state
        return new_state(state, finite, count, inner_state)

    def outcome(state: ApplyIfFiniteState) -> Outcome:
        applied = state.last_finite or (
            max_consecutive_errors is not None and state.notfinite_count > max_consecutive_errors
        )
        return _inner_outcome(inner, state.inner_state) if applied else Outcome.REJECTED

    return GradientTransformation(
        init, update, "apply_if_finite", outcome=outcome, fused=fused, inner=(inner,), global_norms=1
    )


# --- accumulate -------------------------------------------------------------------------


class AccumulateState(NamedTuple):
    """The state of ``accumulate`` (optax's ``MultiStepsState``).

    Attributes:
        mini_step: calls accumulated so far in this round.
        gradient_step: rounds completed (updates the inner transformation got).
        inner_opt_state: the wrapped transformation's state.
        acc_grads: the round's mean (or sum) so far, one gradient shard per unit; its
            ``received``: what any call of the round reached.
        skip_state: what ``should_skip_update_fn`` returned beside its decision at the
            last call (optax's ``skip_state``); ``()`` without one.
        last_skipped: whether ``should_skip_update_fn`` skipped the last call.
    """

    mini_step: int  # calls accumulated so far in this round
    gradient_step: int  # rounds completed (updates the inner transformation got)
    inner_opt_state: Any
    acc_grads: Sharded  # the round's mean (or sum) so far; its ``received``: what any call reached
    skip_state: Any = ()  # should_skip_update_fn's own state (optax's name); () without one
    last_skipped: bool = False  # whether should_skip_update_fn skipped the last call


def accumulate(
    every: int | Callable[[int], int],
    inner: GradientTransformation,
    *,
    use_grad_mean: bool = True,
    accumulator_dtype: torch.dtype | None = torch.float32,
    should_skip_update_fn: Callable[[Updates, int, Params | None], tuple[Any, Any]] | None = None,
) -> GradientTransformation:
    """Accumulate ``every`` calls' gradients; give ``inner`` their mean on the last one (optax's ``MultiSteps``).

    The other calls' updates are zero and ``inner``'s state stays as it was. A parameter
    counts as reached if any call of the round reached it. The round's mean (or sum) is
    kept in ``accumulator_dtype`` (float32, as optax's ``MultiSteps``: 64 bf16 gradients
    summed in bf16 lose most of their low bits) and cast to each unit's gradient dtype for
    ``inner``, as optax casts it like the updates. At a round's end the accumulator is set to
    zero (optax multiplies it by zero, so a round that summed a NaN stays NaN in the next;
    here the next round starts clean). Memory: one gradient shard per unit in
    ``accumulator_dtype``; no communication of its own. In a train step,
    ``TrainState.step`` counts rounds, not calls.

    Args:
        every: calls per round, a whole number ``>= 1``, or a schedule
            ``every(rounds_completed) -> calls`` (optax's ``every_k_schedule``).
        inner: the transformation the round's gradient is given to.
        use_grad_mean: give ``inner`` the mean of the round's gradients; ``False``: their
            sum.
        accumulator_dtype: the dtype the round's mean (or sum) is kept in (optax's
            ``accumulator_dtype``); ``None``: each unit's parameters' dtype.
        should_skip_update_fn: optax's ``MultiSteps`` argument:
            ``should_skip_update_fn(grads, gradient_step, params) -> (skip, skip_state)``,
            ``skip`` a bool (or 0-d tensor or array); a skipped call is not accumulated,
            leaves the state as it was but for ``skip_state`` and gives zero updates (its
            ``outcome`` says ``REJECTED``). It sees this rank's shards: a call is skipped
            on every rank when it says skip on any (one all-reduce of one number a call).

    Returns:
        A ``GradientTransformation`` whose state is ``AccumulateState`` and whose
        ``outcome`` says ``DEFERRED`` within a round.

    Raises:
        TypeError: if ``inner`` is not a ``GradientTransformation``.
        ValueError: if ``every`` (or, at a call, what its schedule returns) is not a whole
            number ``>= 1``.
        TypeError: if ``accumulator_dtype`` is neither ``None`` nor a floating torch dtype.

    Examples:
        >>> from fsdp_fn import sgd
        >>> accumulate(4, sgd()).needs_whole_gradient
        True
    """
    inner = _check(inner, "accumulate")
    if not callable(every):
        _every_ok(every)
    check_float_dtype(accumulator_dtype, "accumulate: accumulator_dtype")

    def k_at(gradient_step: int) -> int:
        return _every_ok(every(gradient_step)) if callable(every) else every

    def init(params: Params) -> AccumulateState:
        acc = zeros_like(params)
        if accumulator_dtype is not None:
            acc = acc.replace({u: t.to(accumulator_dtype) for u, t in acc.shards.items()})
        acc = acc.with_received({})
        skip_state = () if should_skip_update_fn is None else should_skip_update_fn(acc, 0, params)[1]
        return AccumulateState(0, 0, inner.init(params), acc, skip_state)

    def skips(grads: Updates, state: AccumulateState, params: Params | None) -> tuple[bool, Any]:
        """``should_skip_update_fn``'s decision, the same on every rank (any rank's skip), and its state."""
        if should_skip_update_fn is None:
            return False, state.skip_state
        skip, skip_state = should_skip_update_fn(grads, state.gradient_step, params)
        flag = torch.tensor(float(bool(skip)), dtype=torch.float64)
        all_reduce_over_(
            flag, [grads.layout.group] + ([grads.layout.tensor_axis.group] if grads.layout.tensor_axis else [])
        )
        if grads.layout.replicas > 1:
            all_reduce_over_(flag, grads.layout.replica_groups)
        return bool(flag > 0), skip_state

    def cast_like(acc: Sharded, grads: Updates) -> Sharded:
        """The round's result in the gradients' dtype, unit by unit, for ``inner`` (optax's ``cast_like``)."""
        return acc.replace({u: t.to(grads[u].dtype) for u, t in acc.shards.items()})

    def summed(grads: Updates, acc: Sharded, n: int, out_of_place: bool) -> Sharded:
        shards, received = {}, {}
        for unit in grads.plan.units:
            a, got = acc[unit.name], grads.mask(unit)
            if any(got):
                g = grads[unit.name].to(a.dtype)
                if use_grad_mean:
                    a = a.lerp(g, 1 / (n + 1)) if out_of_place else a.lerp_(g, 1 / (n + 1))
                else:
                    a = a + g if out_of_place else a.add_(g)
            elif use_grad_mean and n and any(acc.mask(unit)):  # this call's gradient is zero here
                a = a * (n / (n + 1)) if out_of_place else a.mul_(n / (n + 1))
            shards[unit.name] = a
            received[unit.name] = tuple(x or y for x, y in zip(acc.mask(unit), got, strict=True))
        return Sharded(shards, acc.layout, received)

    def update(
        grads: Updates, state: AccumulateState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, AccumulateState]:
        skip, skip_state = skips(grads, state, params)
        if skip:
            return _nothing(grads), state._replace(skip_state=skip_state, last_skipped=True)
        state = state._replace(skip_state=skip_state, last_skipped=False)
        acc = summed(grads, state.acc_grads, state.mini_step, out_of_place=True)
        if state.mini_step + 1 < k_at(state.gradient_step):
            return _nothing(grads), state._replace(mini_step=state.mini_step + 1, acc_grads=acc)
        updates, inner_state = call_update(inner, cast_like(acc, grads), state.inner_opt_state, params, extra)
        fresh = zeros_like(acc).with_received({})
        return updates, AccumulateState(0, state.gradient_step + 1, inner_state, fresh, skip_state)

    def fused(grads: Updates, state: AccumulateState, params: Params) -> AccumulateState:
        skip, skip_state = skips(grads, state, params)
        if skip:
            return state._replace(skip_state=skip_state, last_skipped=True)
        state = state._replace(skip_state=skip_state, last_skipped=False)
        acc = summed(grads, state.acc_grads, state.mini_step, out_of_place=False)
        if state.mini_step + 1 < k_at(state.gradient_step):
            return state._replace(mini_step=state.mini_step + 1, acc_grads=acc)
        inner_state = update_in_place(inner, cast_like(acc, grads), state.inner_opt_state, params)
        for t in acc.values():
            t.zero_()
        return AccumulateState(0, state.gradient_step + 1, inner_state, acc.with_received({}), skip_state)

    def outcome(state: AccumulateState) -> Outcome:
        if state.last_skipped:
            return Outcome.REJECTED
        return Outcome.DEFERRED if state.mini_step else _inner_outcome(inner, state.inner_opt_state)

    name = f"accumulate({every if not callable(every) else 'schedule'})"
    return GradientTransformation(
        init,
        update,
        name,
        outcome=outcome,
        fused=fused,
        inner=(inner,),
        global_norms=int(should_skip_update_fn is not None),  # its decision's one all-reduce of one number
    )


def _every_ok(every: Any) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"accumulate: every must be a whole number of calls >= 1, got {every!r}")
    return every


# --- masked and multi_transform ---------------------------------------------------------


def _as_select(
    mask: Callable[[str, tuple[int, ...]], Any] | Mapping[str, Any], where: str
) -> Callable[[str, tuple[int, ...]], Any]:
    if isinstance(mask, Mapping):
        table = dict(mask)

        def select(name: str, shape: tuple[int, ...]) -> Any:
            if name not in table:
                raise KeyError(f"{where}: parameter {name!r} is not in the mapping")
            return table[name]

        return select
    if not callable(mask):
        raise TypeError(f"{where}: takes a callable (name, shape) -> value or a mapping by name, got {mask!r}")
    return mask


def _check_names(mask: Any, params: Params, where: str) -> None:
    """Refuse a mapping by name that names a parameter the plan does not have (optax's init
    raises on a mask tree of another structure)."""
    if not isinstance(mask, Mapping) or not isinstance(params, Sharded):
        return
    known = {n for spec in params.plan.params for n in (spec.name, *spec.aliases)}
    unknown = [k for k in mask if k not in known]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        names = sorted(known)
        raise KeyError(
            f"{where}: the mapping names {unknown[0]!r}{more}, which is no parameter of the plan; its parameters: "
            f"{names[:6]}{' ...' if len(names) > 6 else ''}"
        )


def _restricted(grads: Updates, keep: Callable[[Unit], tuple[bool, ...]]) -> Updates:
    """``grads`` marked as reaching only the received parameters ``keep`` selects."""
    return grads.with_received(
        {u.name: tuple(a and b for a, b in zip(grads.mask(u), keep(u), strict=True)) for u in grads.plan.units}
    )


class MaskedState(NamedTuple):
    """The state of ``masked``.

    Attributes:
        inner_state: the wrapped transformation's state (over every parameter).
    """

    inner_state: Any


def masked(inner: GradientTransformation, mask: ParamMask | Mapping[str, bool]) -> GradientTransformation:
    """Apply ``inner`` to the parameters ``mask`` selects; the others' updates pass through (optax's ``masked``).

    ``inner``'s state covers every parameter (a unit is one flat shard); the unselected
    ones' stays as it was. Memory: ``inner``'s, and one new tensor per unit ``mask``
    splits; no communication of its own.

    Args:
        inner: the transformation to apply to the selected parameters.
        mask: ``mask(name, shape) -> bool``, or a mapping from every parameter's name to a
            bool.

    Returns:
        A ``GradientTransformation`` whose state is ``MaskedState``.

    Raises:
        TypeError: if ``inner`` is not a ``GradientTransformation`` or ``mask`` is neither
            callable nor a mapping.
        KeyError: from ``init`` (and ``update``), if a mapping ``mask`` lacks a parameter's
            name or names one the plan does not have.

    Examples:
        >>> from fsdp_fn import scale
        >>> masked(scale(0.5), lambda name, shape: len(shape) > 1).name
        'masked(scale(0.5))'
    """
    inner = _check(inner, "masked")
    select = _as_select(mask, "masked")
    cache: dict[Unit, tuple[bool, ...]] = {}  # by the unit itself: the value may serve several trees

    def chosen(unit: Unit) -> tuple[bool, ...]:
        if unit not in cache:
            cache[unit] = tuple(bool(select(p.name, p.shape)) for p in unit.params)
        return cache[unit]

    def init(params: Params) -> MaskedState:
        _check_names(mask, params, "masked")
        if isinstance(params, Sharded):
            for unit in params.plan.units:
                chosen(unit)  # a mapping that lacks a parameter raises here, as optax's init
        return MaskedState(inner.init(params))

    def update(
        grads: Updates, state: MaskedState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MaskedState]:
        inner_updates, inner_state = call_update(inner, _restricted(grads, chosen), state.inner_state, params, extra)
        out = {}
        for unit in grads.plan.units:
            mine = [a and b for a, b in zip(grads.mask(unit), chosen(unit), strict=True)]
            if not any(mine):
                out[unit.name] = grads[unit.name]
            elif all(chosen(unit)):
                out[unit.name] = inner_updates[unit.name]
            else:
                where = element_mask(unit, chosen(unit), grads.layout, grads[unit.name].device)
                out[unit.name] = torch.where(where, inner_updates[unit.name], grads[unit.name])
        return grads.replace(out), MaskedState(inner_state)

    return GradientTransformation(
        init,
        update,
        f"masked({inner.name})",
        needs_whole_gradient=False,
        outcome=(lambda s: _inner_outcome(inner, s.inner_state)) if inner.outcome is not None else None,
        inner=(inner,),
    )


class MultiTransformState(NamedTuple):
    """The state of ``multi_transform``.

    Attributes:
        inner_states: each label's transformation's state (over every parameter), by label.
    """

    inner_states: dict[str, Any]


def multi_transform(
    transforms: Mapping[str, GradientTransformation],
    param_labels: Callable[[str, tuple[int, ...]], str] | Mapping[str, str],
) -> GradientTransformation:
    """One transformation per label, each on the parameters of its label (optax's ``multi_transform``).

    ``multi_transform({"adam": ff.adamw(), "frozen": ff.set_to_zero()}, labels)``. Each
    transformation's state covers every parameter; the other labels' stay as they were.
    In a train step each label's transformation runs in place on its own parameters (the
    gradients copied for every label but the last). No communication of its own.

    Args:
        transforms: the transformation of each label.
        param_labels: ``param_labels(name, shape) -> label``, or a mapping from every
            parameter's name to its label.

    Returns:
        A ``GradientTransformation`` whose state is ``MultiTransformState``.

    Raises:
        TypeError: if a transformation is not a ``GradientTransformation`` or
            ``param_labels`` is neither callable nor a mapping.
        KeyError: from ``init`` or ``update``, if a parameter's label names no
            transformation, or a mapping lacks a parameter's name; from ``init``, if a
            mapping names a parameter the plan does not have.

    Examples:
        >>> from fsdp_fn import adamw, sgd
        >>> multi_transform({"a": adamw(), "b": sgd()}, lambda name, shape: "a").name
        'multi_transform(a: adamw, b: sgd)'
    """
    links = {label: _check(t, "multi_transform") for label, t in transforms.items()}
    select = _as_select(param_labels, "multi_transform")
    cache: dict[Unit, tuple[str, ...]] = {}  # by the unit itself: the value may serve several trees

    def labels(unit: Unit) -> tuple[str, ...]:
        if unit not in cache:
            found = tuple(select(p.name, p.shape) for p in unit.params)
            unknown = [(p.name, label) for p, label in zip(unit.params, found, strict=True) if label not in links]
            if unknown:
                raise KeyError(
                    f"multi_transform: parameter {unknown[0][0]!r} has label {unknown[0][1]!r}, which names no "
                    f"transformation (labels: {sorted(links)})"
                )
            cache[unit] = found
        return cache[unit]

    def only(label: str) -> Callable[[Unit], tuple[bool, ...]]:
        return lambda unit: tuple(x == label for x in labels(unit))

    def init(params: Params) -> MultiTransformState:
        _check_names(param_labels, params, "multi_transform")
        for unit in params.plan.units:
            labels(unit)
        return MultiTransformState({label: t.init(params) for label, t in links.items()})

    def update(
        grads: Updates, state: MultiTransformState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, MultiTransformState]:
        results = {
            label: call_update(t, _restricted(grads, only(label)), state.inner_states[label], params, extra)
            for label, t in links.items()
        }
        out = {}
        for unit in grads.plan.units:
            mine = labels(unit)
            if not any(grads.mask(unit)) or not mine:
                out[unit.name] = grads[unit.name]
            elif len(set(mine)) == 1:
                out[unit.name] = results[mine[0]][0][unit.name]
            else:
                value = torch.zeros_like(grads[unit.name])
                for label in dict.fromkeys(mine):
                    where = element_mask(unit, only(label)(unit), grads.layout, value.device)
                    value = torch.where(where, results[label][0][unit.name], value)
                out[unit.name] = value
        return grads.replace(out), MultiTransformState({label: r[1] for label, r in results.items()})

    def fused(grads: Updates, state: MultiTransformState, params: Params) -> MultiTransformState:
        out, last = {}, list(links)[-1]
        for label, t in links.items():
            mine = _restricted(grads, only(label))
            if label != last:  # a link may write into the gradients it is given: not into another label's
                mine = mine.replace(
                    {u.name: mine[u.name].clone() if any(mine.mask(u)) else mine[u.name] for u in mine.plan.units}
                )
            out[label] = update_in_place(t, mine, state.inner_states[label], params)
        return MultiTransformState(out)

    def outcome(state: MultiTransformState) -> Outcome:
        found = [_inner_outcome(t, state.inner_states[label]) for label, t in links.items()]
        return next((k for k in (Outcome.REJECTED, Outcome.DEFERRED) if k in found), Outcome.APPLIED)

    name = "multi_transform(" + ", ".join(f"{label}: {t.name}" for label, t in links.items()) + ")"
    return GradientTransformation(
        init,
        update,
        name,
        needs_whole_gradient=False,
        outcome=outcome if any(t.outcome is not None for t in links.values()) else None,
        fused=fused,
        inner=tuple(links.values()),
    )


# --- inject_hyperparams -----------------------------------------------------------------


class InjectHyperparamsState(NamedTuple):
    """The state of an ``inject_hyperparams`` transformation.

    Attributes:
        count: the updates applied before the next one: what scheduled hyper-parameters
            read.
        hyperparams: the numeric hyper-parameters' values at the last update; replace one
            to change it.
        inner_state: the inner transformation's state.
    """

    # updates applied before the next one: what scheduled hyper-parameters read (optax's name: it shadows tuple.count)
    count: int  # type: ignore[assignment]
    hyperparams: dict[str, float | int]  # their values at the last update; replace one to change it
    inner_state: Any


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _as_number(value: Any, where: str) -> float | int:
    """A hyper-parameter's value as a Python number: an int or float as it is, anything
    ``float()`` takes (a 0-d tensor or array) as a float."""
    if _is_number(value):
        return value  # type: ignore[no-any-return]
    try:
        if isinstance(value, bool | str):
            raise TypeError
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{where} must be a number, got {type(value).__name__} {value!r}") from None


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: str | Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """Make ``factory``'s numeric hyper-parameters part of the state (optax's ``inject_hyperparams``).

    ``inject_hyperparams(ff.adamw)(lr=1e-3, weight_decay=0.1)``. As optax's, every numeric
    argument of ``factory``, given by keyword or by position or left at its default, is
    injected: kept in ``state.hyperparams``, where it can be changed between steps
    (``state._replace(hyperparams={**state.hyperparams, "lr": 1e-4})``). A callable is a
    schedule of ``state.count`` (the updates applied before), evaluated at each update;
    a callable that is not a schedule (a mask) goes in ``static_args``. Booleans, ``None``,
    tuples and the ``static_args`` are passed as they are. The inner transformation is
    rebuilt from the values at each update (cheap: closures), so its fused form still runs
    in a train step. Memory and communication: the inner transformation's.

    Where optax ignores a value set in the state that it does not read (a key it did not
    inject, a scheduled one), this raises: a change that would be ignored is an error.

    Args:
        factory: a function that builds a ``GradientTransformation`` (``ff.adamw``,
            ``ff.scale``, ``ff.clip_by_global_norm``, ...).
        static_args: the names of ``factory``'s arguments never to inject or schedule
            (optax's ``static_args``): a callable that is not a schedule.

    Returns:
        ``build(*args, **kwargs) -> GradientTransformation`` whose state is
        ``InjectHyperparamsState``. ``build`` takes ``factory``'s arguments and raises
        ``TypeError`` if they do not fit its signature or ``factory`` does not return a
        ``GradientTransformation``; its ``update`` raises ``TypeError`` if a schedule does
        not return a number, and ``ValueError`` if ``state.hyperparams`` holds a name that
        is not injected or changes a scheduled one.

    Raises:
        ValueError: if ``static_args`` names an argument ``factory`` does not have.

    Examples:
        >>> from fsdp_fn import clip_by_global_norm, scale
        >>> inject_hyperparams(scale)(step_size=0.5).init(None)
        InjectHyperparamsState(count=0, hyperparams={'step_size': 0.5}, inner_state=EmptyState())
        >>> inject_hyperparams(clip_by_global_norm)(0.1).init(None).hyperparams
        {'max_norm': 0.1, 'norm_type': 2.0}
    """
    static_names = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(factory)
    if not static_names <= set(signature.parameters):
        raise ValueError(
            f"inject_hyperparams: static_args {sorted(static_names - set(signature.parameters))} are not arguments "
            f"of {getattr(factory, '__name__', factory)!r} (its arguments: {list(signature.parameters)})"
        )
    variadic = {n for n, p in signature.parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        fixed = static_names | variadic
        numeric = {k: v for k, v in arguments.items() if k not in fixed and _is_number(v)}
        scheduled = {k: v for k, v in arguments.items() if k not in fixed and k not in numeric and callable(v)}
        injected = sorted([*numeric, *scheduled])

        def at(fn: Callable[[int], Any], k: str, count: int) -> float:
            try:
                return float(fn(count))
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"inject_hyperparams: the schedule for {k!r} did not return a number at count {count} "
                    f"(a callable argument that is not a schedule, such as a mask, goes in static_args={k!r})"
                ) from None

        def values(count: int, current: Mapping[str, Any] | None) -> dict[str, float | int]:
            if current is None:
                out = dict(numeric)
            else:
                unknown = [k for k in current if k not in numeric and k not in scheduled]
                if unknown:
                    raise ValueError(
                        f"inject_hyperparams({getattr(factory, '__name__', 'factory')}): state.hyperparams sets "
                        f"{unknown[0]!r}, which is not an injected hyper-parameter, so it would be ignored "
                        f"(injected: {injected}); pass it to the factory instead"
                    )
                out = {
                    k: _as_number(current.get(k, v), f"inject_hyperparams: hyperparams[{k!r}]")
                    for k, v in numeric.items()
                }
                last = max(count - 1, 0)  # the count its stored value was read at
                for k, fn in scheduled.items():
                    if k in current and current[k] != at(fn, k, last):
                        raise ValueError(
                            f"inject_hyperparams: state.hyperparams sets {k!r} to {current[k]!r}, but {k!r} is "
                            f"scheduled (it was {at(fn, k, last)!r} at count {last}): its schedule gives its value, "
                            "so the change would be ignored; pass a number for it to set it through the state"
                        )
            for k, fn in scheduled.items():
                out[k] = at(fn, k, count)
            return out

        def inner(hyperparams: Mapping[str, float | int]) -> GradientTransformation:
            called = inspect.BoundArguments(signature, {**arguments, **hyperparams})  # type: ignore[arg-type]
            return _check(factory(*called.args, **called.kwargs), "inject_hyperparams")

        probe = inner(values(0, None))

        def init(params: Params) -> InjectHyperparamsState:
            hyperparams = values(0, None)
            return InjectHyperparamsState(0, hyperparams, inner(hyperparams).init(params))

        def update(
            grads: Updates, state: InjectHyperparamsState, params: Params | None = None, **extra: Any
        ) -> tuple[Updates, InjectHyperparamsState]:
            hyperparams = values(state.count, state.hyperparams)
            updates, inner_state = call_update(inner(hyperparams), grads, state.inner_state, params, extra)
            return updates, InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        def fused(grads: Updates, state: InjectHyperparamsState, params: Params) -> InjectHyperparamsState:
            hyperparams = values(state.count, state.hyperparams)
            inner_state = update_in_place(inner(hyperparams), grads, state.inner_state, params)
            return InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        def outcome(state: InjectHyperparamsState) -> Outcome:
            return _inner_outcome(probe, state.inner_state)

        return GradientTransformation(
            init,
            update,
            f"inject_hyperparams({probe.name})",
            needs_whole_gradient=False,
            outcome=outcome if probe.outcome is not None else None,
            fused=fused,
            inner=(probe,),
        )

    return build
