"""The gradient-transformation protocol, as optax has it, over sharded pytrees.

A ``GradientTransformation`` is a value: ``init(params) -> state`` and
``update(grads, state, params) -> (updates, state)``; ``apply_updates(params, updates)``
adds the updates. ``update`` changes nothing it is given. State is a plain pytree: named
tuples of ``Sharded`` trees (sharded like the parameters) and Python numbers (counts).

What the train step needs to know about a transformation is a typed field of the value:
whether its own work needs every unit's gradient at once (``needs_whole_gradient``), what
its last update did when it may apply nothing (``outcome``), and how to run it in place on
buffers the step donates (``fused``: torch's own optimizer kernels, so a step moves no
more memory than the kernels do).

Per unit, ``grads.received`` (part of the tree's structure) says which parameters got a
gradient; every transformation here leaves the others' state as it was and gives them a
zero update, as torch.optim skips a parameter whose ``.grad`` is ``None``.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import optree
import torch

from fsdp_fn._plan import Unit
from fsdp_fn._shard import Layout, Sharded
from fsdp_fn._tree import NAMESPACE

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "Outcome",
    "apply_updates",
    "chain",
    "identity",
    "update_in_place",
]

Params = Sharded
Updates = Sharded
State = Any


class Outcome(enum.Enum):
    """What a transformation's last ``update`` did, for the step (read by ``outcome(state)``).

    Attributes:
        APPLIED: the update was applied.
        DEFERRED: nothing applied yet: the call counts toward a round (``accumulate``).
        REJECTED: nothing applied: the gradient was not finite; the step undoes what its
            forward moved.
    """

    APPLIED = "applied"  # the update was applied
    DEFERRED = "deferred"  # nothing applied yet: the call counts toward a round (``accumulate``)
    REJECTED = "rejected"  # nothing applied: the gradient was not finite, the step undoes what its forward moved


class InitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class UpdateFn(Protocol):
    def __call__(self, grads: Updates, state: State, params: Params | None = None) -> tuple[Updates, State]: ...


def call_update(
    t: GradientTransformation,
    grads: Updates,
    state: State,
    params: Params | None,
    extra: dict[str, Any],
    *,
    donated: bool = False,
) -> tuple[Updates, State]:
    """``t.update(grads, state, params, **extra)`` with the extra arguments ``t`` takes (optax's
    ``with_extra_args_support``): all of them if its ``update`` has ``**kwargs``, else the ones it
    names, none to one that takes none (``value=loss`` for a link that reads the loss).
    ``donated``: ``grads`` are the caller's to overwrite, so ``t.update_donated`` runs when ``t``
    has one."""
    fn = (t.update_donated or t.update) if donated else t.update
    if not extra:
        return fn(grads, state, params)
    return fn(grads, state, params, **_taken(fn, extra))


def _taken(fn: Callable[..., Any], extra: dict[str, Any]) -> dict[str, Any]:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: give it nothing extra
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return extra
    return {k: v for k, v in extra.items() if k in parameters}


class FusedFn(Protocol):
    """``update`` then ``apply_updates``, in place: ``params`` and the state's tensors are
    donated (changed and reused); returns the new state (the same tensors)."""

    def __call__(self, grads: Updates, state: State, params: Params) -> State: ...


class GradientTransformation(NamedTuple):
    """A gradient transformation: ``init(params) -> state`` and ``update(grads, state, params)``.

    ``update`` returns ``(updates, state)`` and changes nothing it is given; both are pure
    functions over sharded pytrees, so ``init`` allocates state shaped like this rank's
    shards and neither communicates unless it says so (a global norm is one all-reduce).

    Attributes:
        init: ``init(params) -> state``: the state for the sharded parameters.
        update: ``update(grads, state, params=None) -> (updates, state)``; it may take
            extra keyword arguments (``value=loss``), which ``chain`` passes to it.
        name: the transformation's name, for messages.
        needs_whole_gradient: its own work reads every unit's gradient (a global norm, a
            sum over calls), so it cannot run unit by unit during backward
            (``Schedule(update_in_backward=True)``); a transformation made by hand is
            assumed to (``True``).
        outcome: ``outcome(state) -> Outcome``: for one that may apply nothing, what its
            last update did; ``None``: it always applies.
        fused: the in-place form the train step runs on donated buffers (``None``:
            ``update``, then the updates added in place).
        inner: the transformations it wraps or chains.
        global_norms: global norms its own update computes (one all-reduce of one number
            each, two with replicas; ``predict_collectives(..., optimizer=)`` counts them).
        max_norms: global max-norms (``norm_type=math.inf``) its own update computes (one
            all-reduce of ``W`` numbers each, none over the replicas).
        update_donated: ``update`` that may write its result into the gradients it is given
            (the step's own, donated): what a chain runs before its last link in a train
            step, so a clip adds no gradient-sized buffer (``None``: ``update``).
        fresh_updates: ``update``'s updates alias nothing but the gradients it was given (new
            tensors, or those gradients passed through): a chain may then hand them to the
            next link's ``update_donated``. A transformation made by hand is assumed not to
            (``False``): its updates may be its state or a cache of its own.

    Examples:
        >>> t = GradientTransformation(lambda params: (), lambda grads, state, params=None: (grads, state))
        >>> t.needs_whole_gradient, t.outcome is None
        (True, True)
    """

    init: InitFn
    update: UpdateFn
    name: str = "transformation"
    needs_whole_gradient: bool = True
    outcome: Callable[[State], Outcome] | None = None
    fused: FusedFn | None = None
    inner: tuple[GradientTransformation, ...] = ()
    global_norms: int = 0
    update_donated: UpdateFn | None = None
    max_norms: int = 0
    fresh_updates: bool = False


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none (an empty named tuple)."""


def _empty(params: Params) -> EmptyState:
    return EmptyState()


def identity() -> GradientTransformation:
    """Pass the gradients through unchanged (optax's ``identity``).

    No memory, no communication: ``update`` returns the gradients it is given.

    Returns:
        A ``GradientTransformation`` whose state is ``EmptyState()``.

    Examples:
        >>> identity().init(None)
        EmptyState()
    """

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        return grads, state

    return GradientTransformation(_empty, update, "identity", needs_whole_gradient=False, fresh_updates=True)


def whole_gradient_links(t: GradientTransformation) -> list[str]:
    """The names of the links of ``t`` (itself included) whose own work needs the whole gradient."""
    own = [t.name] if t.needs_whole_gradient else []
    return own + [name for link in t.inner for name in whole_gradient_links(link)]


def count_global_norms(t: GradientTransformation) -> int:
    """Global norms an applying update of ``t`` computes, its links' included."""
    return t.global_norms + sum(count_global_norms(link) for link in t.inner)


def count_max_norms(t: GradientTransformation) -> int:
    """Global max-norms (``norm_type=math.inf``) an applying update of ``t`` computes, its links' included."""
    return t.max_norms + sum(count_max_norms(link) for link in t.inner)


def _check(t: Any, where: str) -> GradientTransformation:
    if not isinstance(t, GradientTransformation):
        raise TypeError(f"{where} takes GradientTransformations (ff.adamw(), ff.scale(...), ...), got {t!r}")
    return t


# --- applying updates -------------------------------------------------------------------


def apply_updates(params: Params, updates: Updates) -> Params:
    """Add ``updates`` to ``params``, unit by unit, as new tensors (optax's ``apply_updates``).

    Units no parameter of which got an update are the same tensors as in ``params``.
    Memory: one new shard per updated unit; no communication.

    Args:
        params: the sharded parameters; not changed.
        updates: what an ``update`` returned, sharded like ``params``; each unit's update
            is cast to its parameters' dtype.

    Returns:
        New ``Sharded`` parameters: ``params + updates`` for each unit with an update.
    """
    out = {}
    for unit in params.plan.units:
        p = params[unit.name]
        out[unit.name] = (p + updates[unit.name].to(p.dtype)) if any(updates.mask(unit)) else p
    return params.replace(out)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """``apply_updates`` in place on ``params``' shards (donated); returns ``params``."""
    for unit in params.plan.units:
        if any(updates.mask(unit)):
            params[unit.name].add_(updates[unit.name].to(params[unit.name].dtype))
    return params


def update_in_place(t: GradientTransformation, grads: Updates, state: State, params: Params) -> State:
    """One step of ``t`` in place, what the train step runs: ``params`` and ``state`` donated.

    ``t.fused`` when it has one (torch's kernels: no memory beyond theirs); otherwise
    ``t.update`` (new updates and state tensors, freed here), the updates added in place and
    every new state tensor copied into the old one it replaces, so the old state's tensors
    stay the state's. No communication of its own (a transformation's global norm is
    its own all-reduce).

    Args:
        t: the transformation.
        grads: the gradients, sharded like ``params``; donated (may be changed and reused).
        state: ``t``'s state; its tensors are donated (changed and reused).
        params: the sharded parameters; donated: updated in place.

    Returns:
        The new state, holding the same tensors as ``state`` where it can.
    """
    if t.fused is not None:
        return t.fused(grads, state, params)
    updates, new = t.update(grads, state, params)
    apply_updates_(params, updates)
    return copy_into(state, new)


def copy_into(old: State, new: State) -> State:
    """``new`` with each of its tensors that replaces a different one of ``old`` copied into it."""
    leaves_old, spec = optree.tree_flatten(old, namespace=NAMESPACE, none_is_leaf=True)
    leaves_new = spec.flatten_up_to(new)
    out = []
    for a, b in zip(leaves_old, leaves_new, strict=True):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a is not b and a.shape == b.shape:
            a.copy_(b)
            out.append(a)
        else:
            out.append(b)
    return optree.tree_unflatten(spec, out)


# --- chain ------------------------------------------------------------------------------


def chain(*links: GradientTransformation) -> GradientTransformation:
    """Apply ``links`` in order, each to the previous one's updates (optax's ``chain``).

    Extra keyword arguments to ``update`` (optax's ``GradientTransformationExtraArgs``:
    ``update(g, s, p, value=loss)``) go to each link that takes them (its ``update`` names
    them or has ``**kwargs``); the others get none. The wrappers (``masked``,
    ``multi_transform``, ``apply_if_finite``, ``accumulate``, ``inject_hyperparams``) pass them
    on the same way. The train step's in-place form passes none.
    State: the tuple of the links' states. In place (the train step), every link but the
    last runs as ``update`` on the gradients (the step's own, freed after), the last one
    fused when it can be. Out of place, a link with an in-place form runs it on the updates
    the links before it made (when they all make fresh ones, and not on the gradients the
    chain was given), as XLA reuses a chain's intermediate buffers: one gradient-sized buffer
    less per such link. Memory and communication: the links' own.

    Args:
        *links: the transformations, applied first to last; none: the identity.

    Returns:
        A ``GradientTransformation`` whose state is the tuple of the links' states and
        whose ``outcome`` is the first of rejected or deferred among the links'.

    Raises:
        TypeError: if a link is not a ``GradientTransformation``.

    Examples:
        >>> from fsdp_fn import adamw, clip_by_global_norm
        >>> chain(clip_by_global_norm(1.0), adamw()).needs_whole_gradient
        False
    """
    links = tuple(_check(t, "chain") for t in links)

    def init(params: Params) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in links)

    def update(
        grads: Updates, state: tuple[Any, ...], params: Params | None = None, **extra: Any
    ) -> tuple[Updates, tuple[Any, ...]]:
        given = {t.untyped_storage().data_ptr() for t in grads.shards.values()}  # (never overwritten)
        new = []
        for k, (t, s) in enumerate(zip(links, state, strict=True)):
            donated = k > 0 and t.update_donated is not None and all(link.fresh_updates for link in links[:k])
            grads, s = call_update(t, grads, s, params, extra, donated=donated and not _shares_memory(grads, given))
            new.append(s)
        return grads, tuple(new)

    def outcome(state: tuple[Any, ...]) -> Outcome:
        found = [t.outcome(s) for t, s in zip(links, state, strict=True) if t.outcome is not None]
        for kind in (Outcome.REJECTED, Outcome.DEFERRED):
            if kind in found:
                return kind
        return Outcome.APPLIED

    def fused(grads: Updates, state: tuple[Any, ...], params: Params) -> tuple[Any, ...]:
        if not links:  # the identity: the gradients are the updates
            apply_updates_(params, grads)
            return state
        new = []
        for t, old in zip(links[:-1], state[:-1], strict=True):
            grads, s = (t.update_donated or t.update)(grads, old, params)
            new.append(copy_into(old, s))
        new.append(update_in_place(links[-1], grads, state[-1], params))
        return tuple(new)

    name = "chain(" + ", ".join(t.name for t in links) + ")"
    return GradientTransformation(
        init,
        update,
        name,
        needs_whole_gradient=False,
        outcome=outcome if any(t.outcome is not None for t in links) else None,
        fused=fused,
        inner=links,
        fresh_updates=all(t.fresh_updates for t in links),
    )


def _shares_memory(updates: Updates, storages: set[int]) -> bool:
    """Whether a received unit's tensor in ``updates`` lives in one of ``storages`` (their data pointers)."""
    return any(updates[u.name].untyped_storage().data_ptr() in storages for u in received_units(updates))


# --- unit-by-unit helpers ---------------------------------------------------------------


def no_update(unit: Unit, like: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A unit's update where none of its parameters got a gradient: zeros that own no memory."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(unit.shard_numel(layout.world))


def element_mask(unit: Unit, mask: Sequence[bool], layout: Layout, device: torch.device) -> torch.Tensor:
    """This rank's shard of ``unit`` as booleans: True where the element is a parameter that ``mask`` marks."""
    out = torch.zeros(unit.shard_numel(layout.world), dtype=torch.bool, device=device)
    for i, lo, hi in unit.local_ranges(layout.world, layout.rank):
        if mask[i] and lo < hi:
            out[lo:hi] = True
    return out


def per_element(unit: Unit, values: torch.Tensor, layout: Layout, fill: float = 1.0) -> torch.Tensor:
    """One value per parameter (shape ``(P,)``) spread over this rank's shard's elements (``fill`` on padding)."""
    out = torch.full((unit.shard_numel(layout.world),), fill, dtype=values.dtype, device=values.device)
    for i, lo, hi in unit.local_ranges(layout.world, layout.rank):
        if lo < hi:
            out[lo:hi] = values[i]
    return out


def drop_frozen(
    unit: Unit, grad: torch.Tensor | None, mask: Sequence[bool], frozen: frozenset[str], layout: Layout
) -> tuple[bool, ...]:
    """``mask`` without the parameters frozen since the plan (``Plan.check_trainable``); their
    elements of ``grad`` (a step's own gradient shard) are zeroed in place, so no norm counts
    them, as torch counts no ``None`` gradient."""
    keep = tuple(got and spec.name not in frozen for spec, got in zip(unit.params, mask, strict=True))
    if grad is not None and keep != tuple(mask):
        gone = [got and not k for got, k in zip(mask, keep, strict=True)]
        grad.masked_fill_(element_mask(unit, gone, layout, grad.device), 0)
    return keep


def received_units(grads: Updates) -> list[Unit]:
    """The units at least one parameter of which got a gradient."""
    return [u for u in grads.plan.units if any(grads.mask(u))]


def map_units(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    grads: Updates,
    states: Sequence[Sharded],
) -> tuple[Updates, list[Sharded]]:
    """``fn(unit, mask, grad, *state_tensors) -> (update, *new_state_tensors)`` for each unit
    that got a gradient (``mask``: which of its parameters did); the other units keep their
    state tensors and get ``no_update``. In a unit only some of whose parameters got one,
    the others' elements keep their old state and get a zero update (per-parameter state,
    such as step counts, is ``fn``'s to count). Returns the updates (``grads``' structure)
    and the new states. Memory: new tensors for what ``fn`` computes; no communication."""
    layout = grads.layout
    updates: dict[str, torch.Tensor] = {}
    new: list[dict[str, torch.Tensor]] = [{} for _ in states]
    for unit in grads.plan.units:
        g = grads[unit.name]
        mask = grads.mask(unit)
        olds = [s[unit.name] for s in states]
        if not unit.params or not any(mask):
            updates[unit.name] = no_update(unit, g, layout)
            for k, old in enumerate(olds):
                new[k][unit.name] = old
            continue
        update, *out = fn(unit, mask, g, *olds)
        if not all(mask):
            keep = element_mask(unit, mask, layout, g.device)
            update = torch.where(keep, update, torch.zeros((), dtype=update.dtype, device=g.device))
            out = [torch.where(keep, o, old) if o.shape == g.shape else o for o, old in zip(out, olds, strict=True)]
        updates[unit.name] = update
        for k, o in enumerate(out):
            new[k][unit.name] = o
    return grads.replace(updates), [s.replace(n) for s, n in zip(states, new, strict=True)]


def state_kinds(state: State) -> Any:
    """The shape of an optimizer state without its values: each named tuple's type and fields,
    tuples, dicts' keys, and leaves by kind (sharded, tensor, number, None). Two states of one
    transformation have the same kinds; another transformation's state does not."""
    if isinstance(state, Sharded):
        return "Sharded"
    if isinstance(state, torch.Tensor):
        return "tensor"
    if isinstance(state, tuple):
        kids = tuple(state_kinds(s) for s in state)
        fields = getattr(state, "_fields", None)
        return (type(state).__name__, tuple(fields), kids) if fields is not None else kids
    if isinstance(state, dict):
        return tuple((k, state_kinds(v)) for k, v in state.items())
    if state is None or isinstance(state, bool | int | float):
        return type(state).__name__
    return type(state).__name__


def describe_kinds(kinds: Any) -> str:
    """The named tuples of a state's kinds, outermost first: how a message names a state."""
    names: list[str] = []

    def visit(k: Any) -> None:
        if isinstance(k, tuple) and len(k) == 3 and isinstance(k[0], str) and isinstance(k[1], tuple):
            names.append(k[0])
            for kid in k[2]:
                visit(kid)
        elif isinstance(k, tuple):
            for kid in k:
                visit(kid[1] if isinstance(kid, tuple) and len(kid) == 2 and isinstance(kid[0], str) else kid)

    visit(kinds)
    return ", ".join(dict.fromkeys(names)) or "no named state"
