"""Activation memory of one step, predicted on fake tensors: nothing real is allocated.

``estimate_activations`` runs the model's forward, the loss and the backward once on
``FakeTensorMode`` tensors (shapes and dtypes only, no data, no communication), with the
units a ``Remat`` selects rematerialised exactly as the train step does. Meanwhile it
follows, op by op, the bytes of the storages that are alive, as ``MemoryMeter`` does on
a real step, leaving out the parameters and their gradients (the plan's part of the
estimate): so the loss's backward transients (a language model's logits, their
log-softmax and gradients) are in the figure, not guessed. Saved-tensor hooks, used in
the forward only, say which unit's forward holds what for backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_fn._functional import Functional, entries_set
from fsdp_fn._plan import ROOT, Plan, Policy, unit_label
from fsdp_fn._policy import MixedPrecision
from fsdp_fn._remat import Remat, route_torch_checkpoint
from fsdp_fn._remat._function import _remat_with_state

LOSS = "(loss)"
"""Where the loss function's own work is counted (what it computes outside the model)."""


@dataclass(frozen=True)
class UnitActivations:
    """One unit's part of the activations (bytes on one rank).

    Attributes:
        name: the unit's name (``ROOT`` for the root's own work, ``LOSS`` for the loss
            function's work outside the model).
        saved: what autograd holds from the unit's forward until its backward (each
            storage counted once, for the first unit that saves it; a rematerialised unit
            saves its inputs and what its policy keeps).
        recompute: for a rematerialised unit, what its recomputation in backward creates
            and holds for the unit's backward; 0 for any other unit.
    """

    name: str
    saved: int
    recompute: int = 0


@dataclass(frozen=True)
class ActivationStage:
    """A stretch of the step with the same gradients alive, and its activation peak.

    Attributes:
        reduced: the units whose gradient is complete (their gradient shards exist).
        running: the unit whose backward runs (its full gradient is being made); ``None``
            in the forward and the loss.
        peak: the most activation bytes alive during the stretch, on one rank.
        in_forward: the stretch is the forward and the loss (units gathered as they run);
            ``False`` from the loss's backward on.
        full_gradient: one of the running unit's gradients is complete, so its full
            gradient exists (a rematerialised unit's come out of its recomputation's backward
            at its end).
    """

    reduced: frozenset[str]
    running: str | None
    peak: int
    in_forward: bool = False
    full_gradient: bool = True


@dataclass(frozen=True)
class ActivationEstimate:
    """What a step's activations and temporaries take on one rank, from one fake step.

    Attributes:
        saved: bytes alive at the end of the forward (the loss computed, backward not
            started): what the backward will read.
        peak: the most bytes alive at once over the forward and the backward.
        peak_op: the operator that produced the peak.
        peak_in: where the peak was: ``"forward"`` or ``"backward"``.
        stages: the peak of each stretch of the step with the same gradients alive
            (``estimate_memory`` adds those gradients to each).
        units: per unit (and ``LOSS``), what is held for backward.
        remat: the names of the units rematerialised.
    """

    saved: int
    peak: int
    peak_op: str
    peak_in: str
    stages: tuple[ActivationStage, ...]
    units: tuple[UnitActivations, ...]
    remat: frozenset[str]

    def unit(self, name: str) -> UnitActivations:
        """One unit's part of the estimate, by name.

        Args:
            name: a unit's name (as in ``Plan.unit_names``), ``ROOT`` or ``LOSS``.

        Returns:
            The unit's ``UnitActivations``.

        Raises:
            KeyError: if the estimate has no unit ``name``; the message lists the units.
        """
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit {unit_label(name)} in the activation estimate; units: {[u.name for u in self.units]}")


class _Live(TorchDispatchMode):
    """Bytes of the storages alive after each op (fake ones: their sizes, no data), the meter's rule."""

    def __init__(self, excluded: set[int], on_sample: Callable[[int], None]) -> None:
        super().__init__()
        self.excluded = excluded  # storages of parameters
        self.entries: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.peak_op = ""
        self.peak_in = self.phase = "forward"
        self.on_sample = on_sample

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch_pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                entry = self.entries.get(key)
                if key not in self.excluded and (entry is None or entry[0].expired()):
                    self.entries[key] = (StorageWeakRef(st), st.nbytes())
        self.sample(str(func))
        return out

    def sample(self, what: str) -> None:
        dead = [k for k, (ref, _) in self.entries.items() if ref.expired()]
        for k in dead:
            del self.entries[k]
        self.current = sum(n for _, n in self.entries.values())
        if self.current > self.peak:
            self.peak, self.peak_op, self.peak_in = self.current, what, self.phase
        self.on_sample(self.current)


def _device(batch: Any) -> torch.device:
    tensors = [t for t in torch_pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    return tensors[0].device if tensors else torch.device("cpu")


def _forwards_replaced(replacements: Mapping[nn.Module, Callable[..., Any]]) -> contextlib.AbstractContextManager[None]:
    """For the block, each module's ``forward`` is the replacement (the module is left as it was)."""
    return entries_set((m.__dict__, "forward", forward) for m, forward in replacements.items())


class _Trace:
    """What one fake step goes through: which unit runs, which gradients exist, what is held.

    Attribution: ``running`` is the innermost unit whose forward (or recomputation) runs,
    else the root while the model runs, else the loss. A stage is a stretch with the same
    units reduced and the same unit in backward; ``stages`` keeps each one's peak.
    """

    def __init__(self, plan: Plan, params: Mapping[str, torch.Tensor]) -> None:
        self.running: list[str] = []
        self.in_model = False
        self.in_backward: list[str] = []  # units whose backward has started and not finished
        self.reduced: set[str] = set()
        self.params_of = {u.name: sum(s.requires_grad for s in u.params) for u in plan.units}
        self.pending = dict(self.params_of)  # per unit: its gradients not complete yet
        self.saved: dict[str, int] = {}
        self.savers: set[int] = set()
        self.recompute: dict[str, int] = {}
        self.stages: dict[tuple[frozenset[str], str | None, bool, bool], int] = {}
        self.params = {p.untyped_storage()._cdata for p in params.values()}
        self.live = _Live(self.params, self.on_sample)

    def where(self) -> str:
        return self.running[-1] if self.running else (ROOT if self.in_model else LOSS)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook (forward only): the first unit that saves a storage holds it."""
        st = t.untyped_storage()
        if st._cdata not in self.params and st._cdata not in self.savers:
            self.savers.add(st._cdata)
            self.saved[self.where()] = self.saved.get(self.where(), 0) + st.nbytes()
        return t

    def on_sample(self, current: int) -> None:
        running = self.in_backward[-1] if self.in_backward else None
        # (from the unit's first complete gradient on, the step holds its full gradient; a
        # rematerialised unit's come out of its recomputation's backward at its end)
        started = running is not None and self.pending[running] < self.params_of[running]
        key = (frozenset(self.reduced), running, self.live.phase == "forward", started)
        self.stages[key] = max(self.stages.get(key, 0), current)

    def begin_backward(self, unit: str) -> None:
        if self.pending.get(unit) and unit not in self.in_backward:
            self.in_backward.append(unit)

    def gradient_done(self, unit: str, p: torch.Tensor) -> None:
        """A parameter's gradient is complete: the step reduce-scatters it and lets it go (the plan's part)."""
        self.begin_backward(unit)
        self.pending[unit] -= 1
        self.live.sample("gradient")  # (the step writes it into the unit's full gradient, alive from here)
        p.grad = None
        if self.pending[unit] == 0:
            self.reduced.add(unit)
            self.in_backward.remove(unit)

    def enter(self, unit: str, module: nn.Module, args: Any) -> None:
        self.running.append(unit)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.running.pop()

    def region(self, unit: str, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A rematerialised unit's function: in backward, measure what its recomputation holds."""
        if self.live.phase != "backward":
            return original(*args, **kwargs)
        self.begin_backward(unit)
        before = self.live.current
        self.running.append(unit)
        try:
            out = original(*args, **kwargs)
        finally:
            self.running.pop()
        self.live.sample("recompute")
        self.recompute[unit] = max(self.recompute.get(unit, 0), self.live.current - before)
        return out

    def model(
        self, fn: Functional, params: Any, buffers: Any, precision: MixedPrecision | None = None
    ) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.in_model = True
            try:
                if precision is None:
                    return fn(params, buffers, *args, **kwargs)
                args, kwargs = precision.cast_inputs(args, kwargs)  # as the train step casts them
                return precision.cast_output(fn(params, buffers, *args, **kwargs))
            finally:
                self.in_model = False

        return run

    def units(self, plan: Plan) -> tuple[UnitActivations, ...]:
        names = [u.name for u in plan.units]
        names = [*([ROOT] if ROOT not in names and ROOT in self.saved else []), *names, LOSS]
        return tuple(UnitActivations(n, self.saved.get(n, 0), self.recompute.get(n, 0)) for n in names)


@contextlib.contextmanager
def _installed(
    trace: _Trace,
    plan: Plan,
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    remat: Remat | None,
    remat_units: frozenset[str],
) -> Iterator[None]:
    """For the block: the trace's hooks on the units' modules and the parameters, and the
    rematerialised units' forwards, as the train step's runtime installs them. Removed after."""
    handles: list[Any] = []
    replaced: dict[nn.Module, Callable[..., Any]] = {}
    try:
        for unit in plan.units:
            for spec in unit.params:
                if spec.requires_grad:
                    hook = functools.partial(trace.gradient_done, unit.name)
                    handles.append(params[spec.name].register_post_accumulate_grad_hook(hook))
            if unit.name == ROOT:
                continue
            for path in unit.modules:
                target = module.get_submodule(path)
                enter = functools.partial(trace.enter, unit.name)
                handles.append(target.register_forward_pre_hook(enter, prepend=True))
                handles.append(target.register_forward_hook(trace.leave))
        for name in remat_units:
            assert remat is not None
            for path in plan.unit(name).modules:  # (a group's modules each)
                target = module.get_submodule(path)
                # The unit's parameters are the region's inputs (the fake ones functional_call puts in place).
                region = functools.partial(trace.region, name, target.forward)
                replaced[target] = _remat_with_state(region, [target], remat.policy, name)
        with _forwards_replaced(replaced):
            yield
    finally:
        for h in handles:
            h.remove()


def estimate_activations(
    fn: Functional,
    loss_fn: Callable[..., torch.Tensor],
    batch: Any,
    plan: Plan,
    *,
    remat: bool | Policy | Remat | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> ActivationEstimate:
    """Activation bytes of one train step on this rank's ``batch``, without running it.

    Runs ``loss_fn(model, batch)`` and its backward once on fake tensors made from the
    plan's parameter specs (its dtypes; the parameters and their gradients are the plan's
    part of ``estimate_memory`` and are left out here), with the units ``remat`` selects
    rematerialised as ``train_step(remat=...)`` does. Allocates no tensor data and
    communicates nothing; the module is left as it was (hooks and forwards are installed
    for the call only). What it cannot see: the train step's own buffers (gathered units,
    flat gradients, communication buffers: the plan's part) and allocator effects (it
    counts live tensor bytes, as ``MemoryMeter`` does).

    Args:
        fn: the model, from ``functionalize(module)``.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, as ``train_step`` takes it.
        batch: this rank's batch; its tensors become fake ones of the same shapes (meta
            tensors are allowed: only shapes and dtypes are read).
        plan: the plan the step shards by; its parameter specs give the shapes and dtypes.
        remat: what ``train_step(remat=...)`` takes: ``None``/``False`` (no remat),
            ``True`` (every non-root unit), a unit policy, or a ``Remat``.
        mixed_precision: the step's (``Schedule.mixed_precision``): the parameters in its
            ``param_dtype``, the inputs and outputs cast as the step casts them; ``None``:
            the plan's dtypes, no casts.

    Returns:
        The ``ActivationEstimate``: bytes held at the end of the forward, the peak and
        where it was, per unit and per stage.

    Raises:
        TypeError: if ``fn`` is not a ``Functional``, or ``remat`` (or its unit policy's
            answer) is not one of the accepted kinds.
        ValueError: if ``loss_fn`` does not return a one-element tensor that depends on the
            parameters, or a unit ``remat`` selects is not a submodule of the model.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from fsdp_fn import functionalize, layer_policy, make_plan
        >>> mlp = lambda: nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        >>> net = nn.Sequential(mlp(), mlp())
        >>> plan = make_plan(net, layer_policy([nn.Sequential]))  # units "0" and "1"
        >>> loss = lambda model, x: model(x).square().sum()
        >>> x = torch.ones(1024, 64)
        >>> plain = estimate_activations(functionalize(net), loss, x, plan)
        >>> lean = estimate_activations(functionalize(net), loss, x, plan, remat=True)
        >>> plain.unit("1").saved, lean.unit("1").saved  # its input and tanh's output; remat: its input
        (1310720, 262144)
        >>> lean.unit("1").recompute  # what its recomputation holds again in backward
        1310720
        >>> plain.peak > lean.peak, lean.peak_op
        (True, 'aten.tanh_backward.default')
    """
    if not isinstance(fn, Functional):
        raise TypeError(
            f"estimate_activations wants the Functional from functionalize(module), got {type(fn).__name__}"
        )
    chosen = Remat.of(remat)
    remat_units = chosen.selects(plan, fn.module) if chosen is not None else frozenset()
    device = _device(batch)
    mode = FakeTensorMode()

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device) if t.device.type == "meta" else mode.from_tensor(t)

    with mode:
        params = {
            spec.name: torch.empty(
                spec.shape, dtype=mixed_precision.gathered(spec.dtype) if mixed_precision else spec.dtype, device=device
            ).requires_grad_(spec.requires_grad)
            for spec in plan.params
        }
        buffers = {k: fake(v) for k, v in fn.buffers.items()}
        fake_batch = torch_pytree.tree_map(lambda x: fake(x) if isinstance(x, torch.Tensor) else x, batch)
    trace = _Trace(plan, params)
    live = trace.live
    with mode, live, route_torch_checkpoint(), _installed(trace, plan, fn.module, params, chosen, remat_units):
        with torch.autograd.graph.saved_tensors_hooks(trace.pack, lambda t: t):
            loss = loss_fn(trace.model(fn, params, buffers, mixed_precision), fake_batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                "estimate_activations: loss_fn must return a scalar tensor that depends on the parameters, "
                f"got {type(loss).__name__} {getattr(loss, 'shape', '')}"
            )
        live.phase = "backward"
        live.sample("end of forward")
        end_of_forward = live.current
        loss.backward()
        del loss
    return ActivationEstimate(
        saved=end_of_forward,
        peak=live.peak,
        peak_op=live.peak_op,
        peak_in=live.peak_in,
        stages=tuple(ActivationStage(r, u, n, f, g) for (r, u, f, g), n in trace.stages.items()),
        units=trace.units(plan),
        remat=remat_units,
    )
