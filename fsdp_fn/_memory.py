"""Live tensor bytes per rank, by category, over time: one meter for every system measured.

``MemoryMeter`` is a ``TorchDispatchMode``: it sees every tensor an op produces (also
inside ``torch.func`` transforms, autograd's backward and collectives), records each new
storage once with a category, and after every op sums the bytes of the storages still
alive. Storage sizes are re-read at every sample, so memory released by
``untyped_storage().resize_(0)`` (how fsdp_fn and FSDP2 free gathered parameters) is seen.

Categories: a storage's category comes from, in order of precedence, ``meter.tag(...)``
(e.g. the train state's shards and optimizer moments), the innermost ``label(...)`` block
active when it was allocated (fsdp_fn labels gathered buffers, gradients and
communication buffers), a rule the caller passes for other systems' internals, and
otherwise ``"activations"`` (activations and temporaries).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_fn._plan import ROOT, Plan

CATEGORIES = ("params", "gathered", "grads", "optimizer", "buffers", "comm", "activations")

_labels: list[str] = []
_active: list[MemoryMeter] = []


@contextlib.contextmanager
def label(category: str) -> Iterator[None]:
    """Storages allocated inside the block count as ``category`` (cheap when no meter runs)."""
    _labels.append(category)
    try:
        yield
    finally:
        _labels.pop()


def retag(t: torch.Tensor, category: str) -> None:
    """Count ``t``'s storage as ``category`` in every running meter (no-op when none runs)."""
    for meter in _active:
        meter._register(t, category, override=True)


Rule = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], list[tuple[torch.Tensor, str]]]


class _Entry:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, t: torch.Tensor, category: str) -> None:
        st = t.untyped_storage()
        self.ref = StorageWeakRef(st)  # does not keep the storage alive
        self.nbytes = st.nbytes()
        self.category = category

    def current_nbytes(self) -> int:
        """The storage's size now (it may have been resized since), via its weak pointer."""
        return int(torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata).nbytes())


def _tensors(tree: Any) -> list[torch.Tensor]:
    from fsdp_fn._shard import NAMESPACE

    out = []
    for leaf in optree.tree_leaves(tree, namespace=NAMESPACE):
        if isinstance(leaf, torch.Tensor):
            local = getattr(leaf, "_local_tensor", None)  # a DTensor's shard
            out.append(local if isinstance(local, torch.Tensor) else leaf)
    return out


class MemoryMeter(TorchDispatchMode):
    """Measure live tensor bytes on this rank while the ``with`` block runs.

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
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        super().__exit__(*exc)

    # --- registering storages -------------------------------------------------------------

    def _register(self, t: torch.Tensor, category: str, override: bool) -> None:
        if t.device.type == "meta" or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)):
            return
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # wrapper tensors without storage
            return
        entry = self.entries.get(key)
        if entry is None or entry.ref.expired():
            self.entries[key] = _Entry(t, category)
        elif override:
            entry.category = category

    def tag(self, tree: Any, category: str) -> None:
        """Count the tensors in ``tree`` (any pytree, ``Sharded`` included) as ``category``.

        ``"state"`` tags a ``TrainState``: params, optimizer state and buffers each by name.
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
        """A named point on the timeline (e.g. the start of backward)."""
        self.markers.append((len(self.timeline or ()), note))

    # --- sampling --------------------------------------------------------------------------

    def sample(self, what: str = "") -> None:
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
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        category = _labels[-1] if _labels else "activations"
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
        """Bytes by category at the moment the total peaked, and ``"total"``."""
        return dict(self._peak)

    def category_peaks(self) -> dict[str, int]:
        """Each category's own maximum over the block (they need not coincide)."""
        return dict(self._category_peaks)


# --- the estimate, from the plan alone --------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes a train step needs besides activations, predicted from the plan."""

    params: int  # sharded parameters (padding included)
    grads: int  # gradient shards alive at once
    optimizer: int  # optimizer state
    gathered: int  # gathered parameters in flight at most
    full_grad: int  # full (unsharded) unit gradients alive while they are reduce-scattered

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + self.full_grad


def estimate_memory(
    plan: Plan,
    world: int,
    *,
    optimizer_slots: int = 2,
    update_in_backward: bool = False,
    units_in_flight: int = 1,
) -> MemoryEstimate:
    """Predict a step's per-rank memory from the plan alone, before anything is allocated.

    ``optimizer_slots``: shard-sized state tensors per parameter (AdamW 2, SGD with
    momentum 1, plain SGD 0). The root unit, when there is one, stays gathered for the
    whole step; at most ``units_in_flight`` other units are gathered at once.

    >>> from torch import nn
    >>> from fsdp_fn import make_plan
    >>> p = make_plan(nn.Linear(3, 2))
    >>> estimate_memory(p, world=2).params  # 8 elements, 4 per rank
    16
    """
    shard_bytes = {u.name: u.shard_numel(world) * u.dtype.itemsize for u in plan.units}
    params = sum(shard_bytes.values())
    others = sorted((u.gather_bytes(world) for u in plan.units if u.name != ROOT), reverse=True)
    root = next((u.gather_bytes(world) for u in plan.units if u.name == ROOT), 0)
    largest_shard = max(shard_bytes.values())
    counters = 4 * sum(len(u.params) for u in plan.units)  # one float32 step count per trainable parameter
    return MemoryEstimate(
        params=params,
        grads=largest_shard if update_in_backward else params,
        optimizer=optimizer_slots * params + counters,
        gathered=root + sum(others[:units_in_flight]),
        # With update_in_backward one reduce-scatter stays in flight behind the next unit's backward.
        full_grad=(2 if update_in_backward else 1) * max(u.gather_bytes(world) for u in plan.units),
    )
