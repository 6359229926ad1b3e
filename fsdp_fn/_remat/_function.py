"""The rematerialising ``autograd.Function`` and ``remat()``, which wraps a function or a module in it.

Forward: the region runs without autograd under a recording mode, keeping only its inputs (and
the saving policy's results). Backward: it runs again with the forward's random generators
and is pulled back with autograd, or with ``torch.func.vjp`` under a transform.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils._python_dispatch as torch_dispatch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode

from fsdp_fn import _guard
from fsdp_fn._remat._early_stop import _SkipTail, _Trace
from fsdp_fn._remat._errors import RematError
from fsdp_fn._remat._modes import _Checked, _Forward, _Record, _Replay
from fsdp_fn._remat._policies import SavePolicy, save_nothing
from fsdp_fn._remat._state import _installed, _Opaque, _state_slots
from fsdp_fn._standin import StandIn
from fsdp_fn._tree import flatten, unflatten

_current_dispatch_mode = torch_dispatch._get_current_dispatch_mode


def _wrapped(t: torch.Tensor) -> bool:
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def _digest(t: torch.Tensor) -> torch.Tensor | None:
    """Three float64 numbers that move when ``t``'s values do: its sum, the sum of its
    magnitudes, and a sum weighted by position (a permutation). ``None``: no values (an empty
    tensor). Reads ``t`` once; on checked steps only."""
    if t.numel() == 0 or t.is_complex():
        return None
    with torch.no_grad():
        x = t.detach().reshape(-1).double()
        ramp = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) / x.numel()
        return torch.stack([x.sum(), x.abs().sum(), (x * ramp).sum()]).cpu()


class _CapturedCheck(TorchFunctionMode):
    """Forward: refuse a tensor that requires grad but is not an input of the region.

    Its gradient would otherwise be silently zero (the Function's backward only returns
    gradients for its inputs). Intermediate tensors never require grad here: the forward
    runs without autograd (except views of inputs), and under ``torch.func`` on unwrapped tensors.
    """

    def __init__(self, inputs: Sequence[torch.Tensor], where: str) -> None:
        super().__init__()
        self.inputs = {id(t) for t in inputs}
        self.where = where
        self.made: dict[int, weakref.ref[torch.Tensor]] = {}  # tensors the region made (views of inputs)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in torch_pytree.tree_leaves((args, kwargs)):
            # (a stand-in's shape or device may be read; any other use raises its own error)
            if isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, StandIn) and not self._input(t):
                raise RematError(
                    f"remat({self.where}): {getattr(func, '__name__', func)} uses a tensor of shape "
                    f"{tuple(t.shape)} ({t.dtype}) that requires grad but is not an argument of the region, "
                    "so its gradient would be lost; pass it as an argument (for a module's parameters: "
                    "remat the module itself, remat(module)(...))"
                )
        out = func(*args, **(kwargs or {}))
        for t in torch_pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self.made[id(t)] = weakref.ref(t)
        return out

    def _input(self, t: torch.Tensor) -> bool:
        # Under plain autograd the inputs themselves require grad, and so do views the region
        # takes of them (``w[1]``, ``w.mT``: a view of a view has the first one's base).
        if id(t) in self.inputs or (t._base is not None and id(t._base) in self.inputs):
            return True
        ref = self.made.get(id(t))
        return ref is not None and ref() is t


_TENSOR = object()  # where a kept result has a tensor


class _Call:
    """One call of a rematerialised region: the function, its non-tensor inputs, RNG states, kept results."""

    def __init__(
        self, fn: Callable[..., Any], policy: SavePolicy, leaves: list[Any], spec: Any, where: str, state: int = 0
    ) -> None:
        self.fn, self.policy, self.where = fn, policy, where
        self.state = state  # how many of the tensor inputs, first, are a module's parameters and buffers
        self.spec = spec
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.out_spec: Any = None
        self.out_constants: list[Any] = []
        self.out_slots: list[int] = []
        self.rng: tuple[torch.Tensor, list[int], list[torch.Tensor]] | None = None
        # The policy's kept results: their tensors (until autograd has saved them) and the rest.
        self.kept_tensors: list[torch.Tensor] = []
        self.kept_layout: list[tuple[Any, Any, list[Any], tuple[int, ...]]] = []  # (op, spec, leaves, versions)
        self.skip: tuple[list[Any], int] | None = None  # full remat: the forward's operators, where the tail starts
        self.forward: _Forward | None = None  # what the forward ran and made, to check the recomputation against
        self.reached: frozenset[int] = frozenset()  # the inputs the forward's outputs were computed from
        # Inputs needing a gradient that the forward changed in place (``x += ...``): autograd is
        # told (``mark_dirty``), so each is an output too, after the region's own if it returns no alias.
        self.dirty: list[int] = []
        self.extra: list[int] = []  # the dirty inputs the region does not return: outputs after its own
        # On a train step's checked steps: what each output's values came to, for the recomputation
        # to match (a module's own torch.Generator, a counter the forward bumps: values, not shapes).
        self.digests: list[torch.Tensor | None] | None = None

    def keep(self, kept: list[tuple[Any, Any, tuple[int, ...]]]) -> None:
        for op, out, versions in kept:
            leaves, spec = torch_pytree.tree_flatten(out)
            self.kept_tensors += [x for x in leaves if isinstance(x, torch.Tensor)]
            self.kept_layout.append(
                (op, spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves], versions)
            )

    def kept(self, tensors: Sequence[torch.Tensor]) -> list[tuple[Any, Any, tuple[int, ...]]]:
        """The kept results, rebuilt around ``tensors`` (``kept_tensors`` as autograd saved them)."""
        it = iter(tensors)
        out = []
        for op, spec, leaves, versions in self.kept_layout:
            filled = [next(it) if x is _TENSOR else x for x in leaves]
            out.append((op, torch_pytree.tree_unflatten(filled, spec), versions))
        return out

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the function on ``tensors`` (the region's tensor inputs); its tensor outputs, flat."""
        leaves = list(self.constants)
        for i, t in zip(self.slots, tensors, strict=True):
            leaves[i] = t
        args, kwargs = unflatten(leaves, self.spec)
        out_leaves, out_spec = flatten(self.fn(*args, **kwargs))
        if self.out_spec is None:  # the layout only: holding the outputs would keep them alive
            self.out_spec = out_spec
            self.out_constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
            self.out_slots = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        return [out_leaves[i] for i in self.out_slots]

    def outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The function's result: its constants, and ``tensors`` where it returned tensors."""
        tensors = tensors[: len(self.out_slots)]  # (the dirty inputs it does not return come after)
        leaves = list(self.out_constants)
        for i, t in zip(self.out_slots, tensors, strict=True):
            leaves[i] = t
        return unflatten(leaves, self.out_spec)

    def as_before(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The region's inputs for a recomputation: each one the forward changed in place as it
        was before (a fresh copy, which the recomputation changes again and drops), so that
        state such as a BatchNorm's running statistics moves once per step, as without remat."""
        out = list(tensors)
        for i, value in (self.forward.before if self.forward is not None else {}).items():
            out[i] = value.clone()
        return out

    def check_values(self, outs: Sequence[torch.Tensor], which: Sequence[int]) -> None:
        """A checked step's recomputation: outputs ``which`` (``outs``) must come to the forward's
        values (up to rounding: a kernel may change once inputs require grad), or ``RematError``."""
        assert self.digests is not None
        for j, out in zip(which, outs, strict=True):
            want, got = self.digests[j], _digest(out)
            if want is None or got is None or want.shape != got.shape:
                continue
            scale = float(want[1]) + 1e-30
            if float((got - want).abs().max()) > 1e-4 * scale + 1e-12:
                raise RematError(
                    f"remat({self.where}): the recomputation's output #{j} has other values than the forward's "
                    f"(sum {float(got[0]):.7g} against {float(want[0]):.7g}) though it ran the same operators on "
                    "the same shapes: the region must compute the same when it is recomputed, or its gradients "
                    "would be wrong. The global random generators are replayed; a generator of the region's own "
                    "(torch.randn(..., generator=g)) and Python state its forward changes (a counter) are not: "
                    "draw from the global generator, pass such state in as an argument, or leave this unit out "
                    "of remat. (Compared on the train step's checked steps: the first, every step with "
                    'check_schedule="always", or after step.check_next_step())'
                )

    def refuse_writes_to(self, differentiated: Sequence[int]) -> None:
        """Under a ``torch.func`` transform or forward-mode derivatives, the region may not change
        an input they differentiate in place (plain autograd is told of it; they are not)."""
        written = [i for i in differentiated if self.forward is not None and i in self.forward.before]
        if written and written[0] >= self.state:
            raise RematError(
                f"remat({self.where}): the region changes its input #{written[0] - self.state} in place, which "
                "under a torch.func transform (or forward-mode derivatives) a rematerialised region cannot do: "
                "compute it out of place (x = x * s, not x.mul_(s); nn.ReLU(), not nn.ReLU(inplace=True))"
            )

    def saved_inputs(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the backward keeps of the inputs: each dirty one as it was before the forward
        changed it (the input itself holds the changed values now, and may change again)."""
        assert self.forward is not None or not self.dirty
        return [self.forward.before[i] if self.forward and i in self.dirty else t for i, t in enumerate(tensors)]

    def save_rng(self) -> None:
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        self.rng = (torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices])

    @contextlib.contextmanager
    def replay_rng(self) -> Iterator[None]:
        """The generators as they were at the forward, for the block; as they are now, after it."""
        assert self.rng is not None
        cpu, devices, states = self.rng
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(cpu)
            for d, s in zip(devices, states, strict=True):
                torch.cuda.set_rng_state(s, d)
            yield


class _Remat(torch.autograd.Function):
    """Forward: run the region, keep its inputs (and the policy's results; with no policy,
    trace its operators). Backward: recompute it with the forward's RNG state (stopping
    early: the tail no backward reads returns empty tensors) and pull back, with autograd
    under plain autograd (an input the outputs never reach gets no gradient), with
    ``torch.func.vjp`` under a transform. Forward mode (``jvp``): ``torch.func.jvp`` of the
    region. ``vmap``: generated."""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call.save_rng()
        record = _Record(call.policy, tensors, call.state) if call.policy.ops else _Trace(tensors, call.state)
        with _CapturedCheck(tensors, call.where), record:
            outs = call.run(tensors)
        record.check_nothing_kept(outs, call.where)
        call.reached = record.reached(outs)
        call.dirty = record.written_needing_grad()
        call.extra = [i for i in call.dirty if not any(o is tensors[i] for o in outs)]
        guard = _guard.current()
        checked = guard is not None and guard.check and not any(map(_wrapped, outs))
        if isinstance(record, _Record):
            call.keep(record.kept)
            record.kept = []  # (autograd holds them now: the recomputation's own reference would outlive its)
        else:
            kept, before = record.tail()
            record.ops, record.producer = [], {}
            # FSDP_FN_REMAT_EARLY_STOP=0, or a checked step: recompute the tail too
            early = os.environ.get("FSDP_FN_REMAT_EARLY_STOP", "1") == "1" and not checked
            call.skip = (kept, before if early else len(kept))
        call.forward = record
        inputs = {id(t) for t in tensors}
        dirty = {id(tensors[i]) for i in call.dirty}
        # An input returned as-is cannot be both returned and saved: return a view of it (a
        # dirty one is returned itself, as autograd wants, and saved as it was before).
        results = (
            *(o if id(o) in dirty else o.view_as(o) if id(o) in inputs else o for o in outs),
            *(tensors[i] for i in call.extra),
        )
        if checked:
            call.digests = [_digest(o) for o in results]
        return results

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        call: _Call = inputs[0]
        ctx.call = call  # type: ignore[attr-defined]
        ctx.n_inputs = len(inputs) - 1  # type: ignore[attr-defined]
        if call.dirty:  # changed in place: their history is this region's now, as without remat
            ctx.mark_dirty(*(inputs[1 + i] for i in call.dirty))
        # By reference: autograd frees them after this backward; nothing is copied.
        ctx.save_for_backward(*call.saved_inputs(inputs[1:]), *call.kept_tensors)
        ctx.set_materialize_grads(False)
        ctx.primals = inputs[1:]  # type: ignore[attr-defined]  # for jvp; dropped by backward or jvp
        ctx.mark_non_differentiable(*(o for o in output if not (o.is_floating_point() or o.is_complex())))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        ctx.primals = ()  # reverse mode: only the saved tensors, which autograd frees after this
        saved = ctx.saved_tensors
        inputs, kept = list(saved[: ctx.n_inputs]), call.kept(saved[ctx.n_inputs :])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        used = [j for j, g in enumerate(grads) if g is not None]
        result: list[torch.Tensor | None] = [None] * (1 + len(inputs))
        if not wanted or not used:
            return tuple(result)

        def region(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tensors = call.as_before(inputs)
            for i, t in zip(wanted, diff, strict=True):
                tensors[i] = t.clone() if i in call.dirty else t  # (changed in place again: not the leaf)
            extra = [tensors[i] for i in call.extra]
            # Under a transform the recomputation runs more products than the forward (a jvp's
            # tangents pass through this mode too): checked under plain autograd only.
            forward = None if transformed else call.forward
            # Tangents pushed through the recomputation (a jvp, jacfwd or hessian around this
            # backward) run their products through this mode too, where the kept results, handed
            # back in order, would stand in for them: nothing is replayed then.
            mode: Any = (
                _SkipTail(*call.skip, forward, call.where)
                if call.skip is not None
                else _Replay(call.policy, [] if _tangents_pushed() else kept, forward, call.where)
            )
            with mode:
                outs = [*call.run(tensors), *extra]
            return tuple(outs[j] for j in used)

        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        transformed = any(wrapped(t) for t in (*inputs, *(grads[j] for j in used)))
        if not transformed:
            # Plain autograd (a train step, a .backward()): an input the region's outputs do
            # not reach gets no gradient (None), as without remat, so an unused parameter is
            # not stepped; torch.func's vjp would hand it zeros.
            # With create_graph the recomputation starts from the inputs themselves, so the
            # gradients stay differentiable through them.
            create = torch.is_grad_enabled()
            with call.replay_rng(), torch.enable_grad():
                diff = [
                    inputs[i] if create and i not in call.dirty else inputs[i].detach().requires_grad_() for i in wanted
                ]
                outs = region(*diff)
                if call.digests is not None:
                    call.check_values(outs, used)
                reached = [(o, grads[j]) for o, j in zip(outs, used, strict=True) if o.requires_grad]
                if not reached:
                    return tuple(result)
                pulled = torch.autograd.grad(
                    [o for o, _ in reached], diff, [g for _, g in reached], allow_unused=True, create_graph=create
                )
        else:
            call.refuse_writes_to(wanted)
            with call.replay_rng():
                _, pull = torch.func.vjp(region, *(inputs[i] for i in wanted))[:2]
            pulled = pull(tuple(grads[j] for j in used))
        # torch.func's vjp hands zeros to an input no output was computed from; autograd gives
        # None, as it would without remat: a train step's backward (under a vmap in the loss
        # too, which takes this branch) must not count an unused parameter as reached.
        for i, g in zip(wanted, pulled, strict=True):
            result[1 + i] = g if i in call.reached else None
        return tuple(result)

    @staticmethod
    def jvp(ctx: Any, call: Any, *tangents: torch.Tensor | None) -> Any:
        # Forward mode keeps nothing for later: push the tangents through the function once more.
        primals, ctx.primals = ctx.primals, ()
        live = [i for i, t in enumerate(tangents) if t is not None]
        ctx.call.refuse_writes_to(live)

        def region(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
            tensors = ctx.call.as_before(primals)
            for i, t in zip(live, diff, strict=True):
                tensors[i] = t
            return tuple(ctx.call.run(tensors))

        with ctx.call.replay_rng():
            pushed = torch.func.jvp(region, tuple(primals[i] for i in live), tuple(tangents[i] for i in live))
        return pushed[1]


def _tangents_pushed() -> bool:
    """Whether forward-mode derivatives are being taken of what runs now: a ``torch.func``
    jvp level (``jvp``, ``jacfwd``, ``hessian``) or autograd's forward AD."""
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    jvp = torch._C._functorch.TransformType.Jvp
    return any(level.key() == jvp for level in torch._C._functorch.get_interpreter_stack() or [])


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def remat(fn: Callable[..., Any], policy: SavePolicy = save_nothing) -> Callable[..., Any]:
    """``fn`` rematerialised: same signature and result; its backward recomputes it.

    Memory: the forward keeps ``fn``'s tensor inputs by reference (and the outputs of the
    operators ``policy`` names), not its intermediate activations. Compute: the backward
    runs ``fn`` once more, with the CPU (and initialised CUDA) generators set to their
    state at the forward, so dropout masks are the same; gradients equal those without
    remat bitwise. No communication of its own.

    Arguments are any pytree: tensors are the region's inputs (those that require grad,
    at any ``torch.func`` level, get gradients), everything else is a constant. When
    ``fn`` is an ``nn.Module`` or a module's bound method, the module's parameters and
    buffers (read at each call) are inputs too. A tensor that requires grad and reaches
    ``fn`` any other way (a closure) is refused with an error, never silently given no
    gradient. Works under plain autograd (double backward included) and inside every
    ``torch.func`` transform: ``grad``, ``grad_and_value``, ``vjp``, ``jacrev``, ``vmap``
    (vmap's rule is generated from the forward), ``jvp`` and ``jacfwd`` (forward mode
    pushes the tangents through ``fn`` once more: it keeps nothing for later anyway).

    ``fn`` runs twice, differently: in the forward with autograd off and on unwrapped
    tensors (``torch.is_grad_enabled()`` is False), in the backward under
    ``torch.func.vjp``. Bookkeeping that only happens with grad enabled (marking which
    parameters a backward reaches, registering hooks on outputs) happens in the
    recomputation. An input needing no gradient that the forward changes in place (a
    BatchNorm's running statistics and batch counter, through a view too) is copied just
    before that first change, and the recomputation runs on a fresh copy of that value and
    drops it: such state moves once, as without remat (the copy is the buffer's size, held
    until the backward). Other side effects (appending to a Python list) happen twice.
    Under forward-mode derivatives of the backward (``jvp`` of ``grad``, ``hessian``) the
    recomputation runs every operator: ``policy``'s kept results are not handed back there.

    Args:
        fn: the region: any callable over a pytree of arguments; an ``nn.Module`` or a
            module's bound method makes the module's parameters and buffers inputs too.
        policy: the ``SavePolicy`` naming the operators whose outputs the forward keeps;
            ``save_nothing`` keeps only the inputs.

    Returns:
        A function with ``fn``'s signature and result, whose backward recomputes ``fn``.

    Raises:
        TypeError: if ``fn`` is not callable or ``policy`` is not a ``SavePolicy``.
        RematError: when the returned function runs, naming the call and the fix: ``fn``
            uses a tensor that requires grad and is not an argument (a closure); its
            forward keeps a tensor made from its inputs outside its outputs (a module's
            attribute, a Hugging Face key/value cache); under a ``torch.func`` transform or
            forward-mode derivatives it changes an input being differentiated in place; or
            the recomputation runs other operators than the forward (checked under plain
            autograd), or comes to other values (checked on a train step's checked steps).

    Examples:
        >>> import torch
        >>> f = remat(lambda x: torch.tanh(x).sum())
        >>> torch.func.grad(f)(torch.zeros(3))
        tensor([1., 1., 1.])
    """
    if not callable(fn):
        raise TypeError(f"remat wants a callable, got {type(fn).__name__} {fn!r}")
    if not isinstance(policy, SavePolicy):
        raise TypeError(f"remat policy must be a SavePolicy (save_nothing, save_dots, ...), got {policy!r}")
    owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
    if isinstance(owner, nn.Module):
        return _remat_with_state(fn, [owner], policy, _describe(fn))
    return _rematerialised(fn, policy, _describe(fn))


def _rematerialised(
    fn: Callable[..., Any], policy: SavePolicy, where: str, state: Callable[..., int] | None = None
) -> Callable[..., Any]:
    """``remat(fn)``; ``state(*args)``: how many of its tensor inputs, first, are module state."""

    @functools.wraps(fn)
    def rematerialised(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = flatten((args, kwargs))
        call = _Call(fn, policy, leaves, spec, where, state(*args) if state is not None else 0)
        outs = _Remat.apply(call, *(leaves[i] for i in call.slots))
        call.kept_tensors = []  # autograd holds them now (every level's context has been set up)
        return call.outputs(outs)

    return rematerialised


More = tuple[Callable[[], Sequence[torch.Tensor]], Callable[[Sequence[torch.Tensor]], AbstractContextManager[None]]]
"""More inputs of a region: what they are (read at each call), and the block every run of the
region (its forward, each recomputation) runs in, given them as that run sees them."""


def _remat_with_state(
    fn: Callable[..., Any], modules: Sequence[nn.Module], policy: SavePolicy, where: str, more: More | None = None
) -> Callable[..., Any]:
    """``remat(fn)`` where the parameters and buffers of ``modules`` (read at each call) are inputs
    too, and ``more``'s tensors (a runtime's shards of the units ``fn`` calls, which it gathers in
    ``more``'s block)."""
    tensors, block = more if more is not None else (lambda: (), lambda _: contextlib.nullcontext())

    def region(state: list[torch.Tensor], slots: _Opaque, extra: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        with _installed(slots.value, state), block(extra):
            return fn(*args, **kwargs)

    region.__qualname__ = where
    inner = _rematerialised(region, policy, where, state=lambda state, _, extra, *__: len(state) + len(extra))

    @functools.wraps(fn)
    def rematerialised(*args: Any, **kwargs: Any) -> Any:
        state, slots = _state_slots(modules)
        return inner(state, _Opaque(slots), list(tensors()), *args, **kwargs)

    return rematerialised


class outside_region:  # (lower case: a context manager, as torch.no_grad)
    """For the block, the rematerialised regions running now (their forward or recomputation)
    set their modes aside: what runs in it (a unit's all-gather, issued by the runtime from
    inside a region) is neither traced, kept, checked nor left out by them, and its collectives
    always run. No communication, no copy; outside every region, two reads of torch's mode stacks."""

    __slots__ = ("dispatch", "function")

    def __enter__(self) -> outside_region:
        self.dispatch: list[Any] = []
        while isinstance(_current_dispatch_mode(), _Forward | _Checked):
            self.dispatch.append(torch_dispatch._pop_mode())
        self.function: list[Any] = []
        while isinstance(torch.overrides._get_current_function_mode(), _CapturedCheck):
            self.function.append(torch.overrides._pop_mode())
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self.function):
            torch.overrides._push_mode(mode)
        for mode in reversed(self.dispatch):
            torch_dispatch._push_mode(mode)

    @property
    def inside(self) -> bool:
        """Whether a region's forward or recomputation is running."""
        return bool(self.dispatch or self.function)

    def derive(self, tensors: Sequence[torch.Tensor], source: torch.Tensor) -> None:
        """In the regions' forwards, ``tensors`` count as computed from ``source`` (which of their
        inputs the outputs reach)."""
        for mode in self.dispatch:
            if isinstance(mode, _Forward):
                mode.derive(tensors, source)
