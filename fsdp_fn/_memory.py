"""Live tensor bytes per rank, by category, over time: one meter for every system measured.

``MemoryMeter`` is a ``TorchDispatchMode``: it sees every tensor an op produces (also
inside ``torch.func`` transforms, autograd's backward and collectives), records each new
storage once with a category, and after every op sums the bytes of the storages still
alive. Storage sizes are re-read at every sample, so memory released by
``untyped_storage().resize_(0)`` (how fsdp_fn and FSDP2 free gathered parameters) is seen.

Only storages that hold data count. A tensor subclass that wraps others (a ``DTensor``:
torch FSDP2's parameters, gradients and optimizer state) is unwrapped to the tensors it
holds, and an op on one is left to the subclass, so the meter sees the local ops it runs
(as torch's ``MemTracker`` does); a storage that reports bytes but owns no data (a
wrapper's own) is skipped, or the whole model would be counted again.

Categories: a storage's category comes from, in order of precedence, ``meter.tag(...)``
(e.g. the train state's shards and optimizer moments), the innermost ``label(...)`` block
active when it was allocated (fsdp_fn labels gathered buffers, gradients and
communication buffers), a rule the caller passes for other systems' internals, and
otherwise ``"activations"`` (activations and temporaries).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from fsdp_fn import _labels
from fsdp_fn._activations import ActivationEstimate
from fsdp_fn._plan import ROOT, Plan, Unit
from fsdp_fn._policy import Schedule
from fsdp_fn._tree import NAMESPACE

CATEGORIES = ("params", "gathered", "grads", "optimizer", "buffers", "comm", "activations")

Rule = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], list[tuple[torch.Tensor, str]]]


class _Entry:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, st: torch.UntypedStorage, category: str) -> None:
        self.ref = StorageWeakRef(st)  # does not keep the storage alive
        self.nbytes = st.nbytes()
        self.category = category

    def current_nbytes(self) -> int:
        """The storage's size now (it may have been resized since), via its weak pointer."""
        return int(torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata).nbytes())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(leaf, torch.Tensor)]


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages that hold ``t``'s data: a wrapper subclass's inner tensors', recursively."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    if t.device.type == "meta" or isinstance(t, FakeTensor):  # shapes only, no data (estimate_activations)
        return
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper tensor without a storage
        return
    if st.nbytes() > 0 and st.data_ptr() == 0:  # reports a size but owns no data
        return
    yield st


class MemoryMeter(TorchDispatchMode):
    """Measure live tensor bytes on this rank while the ``with`` block runs.

    A ``TorchDispatchMode``: after every op it re-reads the sizes of the storages it has
    seen that are still alive (weak references: it keeps nothing alive) and sums them by
    category. It allocates no tensor and communicates nothing; its own cost is
    host time per op, so meter a step that is measured, not one that is timed.

    Args:
        rule: ``rule(func, args, kwargs, out) -> [(tensor, category), ...]``, called after
            every op: categories for another system's internals (e.g. FSDP2's gathered
            parameters); ``None``: only ``tag`` and fsdp_fn's labels categorise.
        timeline: keep every sample as ``(op, bytes by category)`` in ``meter.timeline``
            (``None`` otherwise), with ``mark``'s notes in ``meter.markers``.

    Examples:
        >>> import torch
        >>> with MemoryMeter() as meter:
        ...     x = torch.ones(1024)
        ...     y = x * 2
        >>> meter.peak()["total"]
        8192
    """

    def __init__(self, rule: Rule | None = None, timeline: bool = False) -> None:
        super().__init__()
        self.rule = rule
        self.entries: dict[int, _Entry] = {}
        self.current: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._peak: dict[str, int] = {**self.current, "total": 0}
        self._category_peaks: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.timeline: list[tuple[str, dict[str, int]]] | None = [] if timeline else None
        self.markers: list[tuple[int, str]] = []

    def __enter__(self) -> MemoryMeter:
        super().__enter__()
        _labels.active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _labels.active.remove(self)
        super().__exit__(*exc)

    # --- registering storages -------------------------------------------------------------

    def _register(self, t: torch.Tensor, category: str, override: bool) -> None:
        for st in _storages(t):
            key = st._cdata
            entry = self.entries.get(key)
            if entry is None or entry.ref.expired():
                self.entries[key] = _Entry(st, category)
            elif override:
                entry.category = category

    def tag(self, tree: Any, category: str) -> None:
        """Count the tensors in ``tree`` (any pytree, ``Sharded`` included) as ``category``.

        A tag overrides the category a storage was given when it was allocated. Takes one
        sample; allocates nothing.

        Args:
            tree: the tensors to count; with ``"state"``, a ``TrainState``.
            category: one of ``CATEGORIES``, or ``"state"``: a ``TrainState``'s params,
                optimizer state and buffers, each under its own category.

        Raises:
            ValueError: if ``category`` is neither one of ``CATEGORIES`` nor ``"state"``.
        """
        if category == "state":
            self.tag(tree.params, "params")
            self.tag(tree.opt_state, "optimizer")
            self.tag(tree.buffers, "buffers")
            return
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; one of {CATEGORIES}")
        for t in _tensors(tree):
            self._register(t, category, override=True)
        self.sample("tag")

    def mark(self, note: str) -> None:
        """Put a named point on the timeline (e.g. the start of backward).

        Args:
            note: the point's name, kept in ``meter.markers`` with the index of the next
                sample on the timeline.
        """
        self.markers.append((len(self.timeline or ()), note))

    # --- sampling --------------------------------------------------------------------------

    def sample(self, what: str = "") -> None:
        """Re-read the live storages' sizes now, and update the peaks and the timeline.

        Called after every op while the block runs; call it by hand after a change no op
        makes (a storage resized outside the block).

        Args:
            what: the sample's name on the timeline (an op's name, by default empty).
        """
        current = dict.fromkeys(CATEGORIES, 0)
        dead = []
        for key, e in self.entries.items():
            if e.ref.expired():
                dead.append(key)
                continue
            e.nbytes = e.current_nbytes()
            current[e.category] += e.nbytes
        for key in dead:
            del self.entries[key]
        self.current = current
        total = sum(current.values())
        if total > self._peak["total"]:
            self._peak = {**current, "total": total}
        for k, v in current.items():
            if v > self._category_peaks[k]:
                self._category_peaks[k] = v
        if self.timeline is not None:
            self.timeline.append((what, current))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # the subclass runs the op as ops on plain tensors, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        category = _labels.current()
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._register(t, category, override=False)
        if self.rule is not None:
            for t, cat in self.rule(func, args, kwargs, out):
                self._register(t, cat, override=True)
        self.sample(str(func))
        return out

    # --- results ---------------------------------------------------------------------------

    def peak(self) -> dict[str, int]:
        """Bytes by category at the moment the total peaked, and ``"total"``.

        Returns:
            ``{category: bytes}`` for every one of ``CATEGORIES`` at that moment, and
            ``"total"``: their sum.
        """
        return dict(self._peak)

    def category_peaks(self) -> dict[str, int]:
        """Each category's own maximum over the block (they need not coincide).

        Returns:
            ``{category: bytes}`` for every one of ``CATEGORIES``.
        """
        return dict(self._category_peaks)


# --- the estimate, from the plan alone --------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of a train step, predicted before anything is allocated.

    The plan's part: ``params``, ``grads``, ``optimizer``, ``gathered``, ``full_grad``,
    each at its own peak. With an ``ActivationEstimate``: ``activations`` and
    ``with_gradients``. ``total`` is the step's peak.

    Attributes:
        params: sharded parameters, trainable and frozen (padding included).
        grads: gradient shards alive at once.
        optimizer: optimizer state.
        gathered: gathered parameters in flight at most.
        full_grad: full (unsharded) unit gradients alive while they are reduce-scattered.
        activations: activations and temporaries at their peak, from one fake step (0: not
            estimated).
        with_gradients: activations plus the gradients and gathered units alive with them
            (shards of the units already reduced, the full gradient of the unit whose
            backward runs; that unit and the ones prefetched after it in backward, or
            ``gathered`` in the forward), at the moment that sum peaks.
    """

    params: int  # sharded parameters, trainable and frozen (padding included)
    grads: int  # gradient shards alive at once
    optimizer: int  # optimizer state
    gathered: int  # gathered parameters in flight at most
    full_grad: int  # full (unsharded) unit gradients alive while they are reduce-scattered
    activations: int = 0  # activations and temporaries at their peak (0: not estimated)
    with_gradients: int = 0  # activations + gradients and gathered units alive with them, at their joint peak

    @property
    def total(self) -> int:
        """The step's peak bytes on one rank.

        Shards and optimizer state throughout, plus, with activations, their joint peak
        with the gradients and gathered units (``with_gradients``, which covers the end of
        backward too); without, the sum of the plan's parts.
        """
        if self.with_gradients:
            return self.params + self.optimizer + self.with_gradients
        return self.params + self.optimizer + self.gathered + self.grads + self.full_grad


def estimate_memory(
    plan: Plan,
    world: int,
    *,
    optimizer_slots: int = 2,
    update_in_backward: bool = False,
    units_in_flight: int = 1,
    activations: ActivationEstimate | None = None,
    schedule: Schedule | None = None,
) -> MemoryEstimate:
    """Predict a step's per-rank memory from the plan alone, before anything is allocated.

    The root unit, when there is one, stays gathered for the whole step; at most
    ``units_in_flight`` other units are gathered at once. Nothing is allocated, nothing
    is communicated.

    Args:
        plan: the plan the step shards by.
        world: the number of ranks sharing each unit (the shard group's size).
        optimizer_slots: shard-sized state tensors per parameter (AdamW 2, SGD with
            momentum 1, plain SGD 0).
        update_in_backward: the optimizer runs unit by unit during backward
            (``Schedule(update_in_backward=True)``): one gradient shard alive at a time.
        units_in_flight: non-root units gathered at once (``Schedule.max_inflight``).
        activations: ``estimate_activations(fn, loss_fn, batch, plan, remat=...)`` on this
            rank's batch (one micro-batch), for the activations (rematerialisation
            included); ``None``: activations are not estimated.
        schedule: the step's ``Schedule``, which then sets ``update_in_backward`` and
            ``units_in_flight`` (``max_inflight``) and adds what it keeps: every unit
            gathered with ``reshard_after_forward=False``, units gathered in
            ``mixed_precision``'s dtype, the gradients summed over earlier micro-batches
            (shards, or every unit's full gradient without ``reduce_each_micro_batch``).

    Returns:
        The ``MemoryEstimate``, each part in bytes on one rank.

    Raises:
        KeyError: if ``activations`` was estimated with another plan (a unit it names is
            not in ``plan``).

    Examples:
        >>> from torch import nn
        >>> from fsdp_fn import make_plan
        >>> p = make_plan(nn.Linear(3, 2))
        >>> estimate_memory(p, world=2).params  # 8 elements, 4 per rank
        16
    """
    if schedule is not None:
        update_in_backward, units_in_flight = schedule.update_in_backward, schedule.max_inflight
        if not schedule.reshard_after_forward:
            units_in_flight = len(plan.units)  # each stays gathered from its forward to its backward
    shard_bytes = {u.name: u.shard_numel(world) * u.dtype.itemsize for u in plan.units}
    params = sum(shard_bytes.values())  # the trainable shards: what gradients and optimizer state mirror
    # The frozen shards, each part in its own dtype (an integer one too), held beside them.
    frozen = sum(part.shard_numel(world) * part.dtype.itemsize for u in plan.units for part in u.frozen_parts)

    def gathered(u: Unit) -> int:
        return u.gather_bytes(world, schedule.gather_dtype(u.dtype) if schedule is not None else None)

    others = sorted((gathered(u) for u in plan.units if u.name != ROOT), reverse=True)
    root = next((gathered(u) for u in plan.units if u.name == ROOT), 0)
    # Gradients an earlier micro-batch left for the later ones, alive through their activations.
    summed = 0
    if schedule is not None and schedule.micro_batches > 1:
        # (summed in the reduce dtype of the gradients, which come in the gathered dtype)
        full = sum(
            u.padded_numel(world) * schedule.reduce_dtype(schedule.gather_dtype(u.dtype)).itemsize for u in plan.units
        )
        summed = params if schedule.reduce_each_micro_batch else full
        summed += 8 * (schedule.micro_batches - 1)  # (and their losses, a number each, float64 at most)
    largest_shard = max(shard_bytes.values(), default=0)
    grads = largest_shard if update_in_backward else params  # the gradient shards alive at once

    def full_bytes(u: Unit) -> int:  # a unit's full (unsharded) gradient
        return u.padded_numel(world) * u.dtype.itemsize

    largest_full = max((full_bytes(u) for u in plan.units), default=0)
    summing = schedule is not None and schedule.micro_batches > 1 and not schedule.reduce_each_micro_batch

    def taken(u: Unit) -> bool:
        """Whether the step takes autograd's gradient of the unit's one parameter as its full
        gradient (no padding, no sum over micro-batches): then the activations count it already."""
        return len(u.params) == 1 and u.padded_numel(world) == u.numel and world > 1 and not summing

    counters = 4 * sum(len(u.params) for u in plan.units)  # one float32 step count per trainable parameter
    in_flight = root + sum(others[:units_in_flight])
    stages = activations.stages if activations is not None else ()
    # In backward a unit is gathered while its backward runs, with the next ones in backward
    # order prefetched; the units whose backward ran are gone (the first unit's backward runs
    # with nothing after it: a rematerialised step's peak may be there). The order is the
    # fake step's: where each unit's backward began, or, for one with no stage of its own (a
    # head's or an embedding's one operator), where its gradient was complete.
    backward: list[str] = []
    for stage in stages:
        for name in [stage.running, *sorted(stage.reduced)]:
            if name is not None and name != ROOT and name not in backward:
                backward.append(name)
    backward += [u.name for u in reversed(plan.units) if u.name != ROOT and u.name not in backward]
    cap = units_in_flight * max(others, default=0)  # the schedule's cap on gathered bytes, prefetches included

    def from_(at: int) -> int:
        """The root, the unit at backward position ``at`` and those after it prefetched while they fit the cap."""
        held = 0
        for name in backward[at:]:
            size = gathered(plan.unit(name))
            if held and held + size > cap:
                break
            held += size
        return root + held

    with_gradients, at = 0, -1  # (at: the backward position reached; -1: still in the forward)
    for stage in stages:
        reduced = [shard_bytes[n] for n in stage.reduced if n in shard_bytes]
        shards = max(reduced, default=0) if update_in_backward else sum(reduced)
        own = stage.running if stage.running != ROOT else None  # (a unit of the backward order)
        if own is not None:
            at = backward.index(own)
            held = from_(at)
        elif stage.in_forward:  # (the units gathered as they run, prefetches included)
            held = in_flight
        else:  # the loss's backward (the first units prefetched), between two units' or after the last
            held = from_(at + 1)
        # The full gradient alive: the running unit's from its first gradient on; before it, and
        # between two units, the one before in backward order, whose reduction lands only then.
        if stage.running is not None and stage.full_gradient:
            running = plan.unit(stage.running)
            full = 0 if taken(running) else full_bytes(running)
        else:
            before = at - 1 if own is not None else at
            full = full_bytes(plan.unit(backward[before])) if before >= 0 else 0
        with_gradients = max(with_gradients, held + stage.peak + shards + full + summed)
    if stages:  # the end of backward: every gradient shard, a unit's full gradient, the root
        with_gradients = max(with_gradients, root + grads + largest_full)
    return MemoryEstimate(
        params=params + frozen,
        grads=grads,
        optimizer=optimizer_slots * params + counters,
        gathered=root + sum(others[:units_in_flight]),
        # One full unit gradient at a time: a unit's reduction ends before the next unit's
        # flat gradient is allocated (with update_in_backward too).
        full_grad=largest_full,
        activations=activations.peak if activations is not None else 0,
        with_gradients=with_gradients,
    )
