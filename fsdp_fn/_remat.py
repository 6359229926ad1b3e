"""Rematerialisation (activation checkpointing) that runs inside ``torch.func`` transforms.

``remat(fn)`` is ``jax.checkpoint`` for PyTorch: the forward keeps only ``fn``'s inputs
(and what the saving policy names); the backward runs ``fn`` again, with the random
number generators replayed, and differentiates the recomputation with ``torch.func.vjp``.
It is an ``autograd.Function`` with a separate ``setup_context``, so it needs no
saved-tensor hooks, which ``torch.func.grad``/``vjp`` refuse (and with them
``torch.utils.checkpoint``). ``route_torch_checkpoint()`` sends
``torch.utils.checkpoint.checkpoint`` calls through it. ``Remat`` is the value a train
step takes: which units to rematerialise and what to save.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_fn import _guard
from fsdp_fn._plan import ROOT, Plan, Policy, unit_label
from fsdp_fn._standin import StandIn
from fsdp_fn._tree import flatten, unflatten

aten = torch.ops.aten


class RematError(RuntimeError):
    """A rematerialised region cannot run as asked; the message names the call and the fix."""


# --- saving policies -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SavePolicy:
    """Which intermediate results of a rematerialised region the forward keeps.

    ``ops``: the aten operators (``torch.ops.aten.mm`` or one overload of it) whose
    outputs are kept; the recomputation takes them instead of running the operator again,
    so it costs fewer flops and the forward keeps more memory. Empty: keep nothing but the
    inputs (full rematerialisation).
    """

    name: str
    ops: frozenset[Any] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if not isinstance(op, torch._ops.OpOverloadPacket | torch._ops.OpOverload)]
        if bad:
            raise TypeError(
                f"SavePolicy {self.name!r}: ops must be aten operators such as torch.ops.aten.mm, got {bad!r}"
            )

    def saves(self, func: Any) -> bool:
        return func in self.ops or func.overloadpacket in self.ops


save_nothing = SavePolicy("save_nothing")
"""Keep only the region's inputs; recompute everything (``jax.checkpoint``'s default)."""

save_dots = SavePolicy(
    "save_dots",
    frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_dot_product_flash_attention_for_cpu}),
)
"""Keep the outputs of matrix multiplications (``nn.Linear`` lowers to ``mm``/``addmm``)
and of CPU fused attention; recompute the cheap element-wise rest (JAX's
``dots_saveable``, torchtitan's op-level selective activation checkpointing)."""


# The operators whose inputs' shapes the recomputation must repeat: the products of linear
# layers and convolutions, which every model's compute goes through. Only these: around them
# the same region may lower to other operators (``empty_like`` under a transform, ``empty``
# here), and attention may take another kernel once its inputs require grad (T5's learned
# position bias: a fused kernel in the forward, products and a softmax in the recomputation).
_CHECKED = frozenset({aten.mm, aten.addmm, aten.convolution})


def _signature(func: Any, args: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], torch.dtype], ...]] | None:
    """A checked operator and its tensor inputs' shapes and dtypes (``None``: not checked)."""
    if func.overloadpacket not in _CHECKED:
        return None
    return func, tuple((tuple(t.shape), t.dtype) for t in torch_pytree.tree_leaves(args) if isinstance(t, torch.Tensor))


class _Checked(TorchDispatchMode):
    """Recomputation: each product of a linear layer or convolution must be the forward's, on
    inputs of the same shapes and dtypes, or ``RematError`` names the region and the first
    difference (torch's checkpoint compares its saved tensors' metadata the same way); and
    it may not read a tensor the forward made from its inputs and kept in state. Values are
    not compared."""

    def __init__(self, forward: _Forward | None, where: str) -> None:
        super().__init__()
        self.forward, self.where, self.checked = forward, where, 0
        self.replayed: set[int] = set()  # kept results handed back (made by the forward, and meant to be read)

    def check(self, func: Any, args: Any, kwargs: Any) -> None:
        if self.forward is None:  # not checked
            return
        for t in torch_pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and self.forward.carries_grad(t) and id(t) not in self.replayed:
                raise RematError(
                    f"remat({self.where}): the recomputation's {func} read a tensor of shape {list(t.shape)} that the "
                    "region's forward made from its inputs and kept outside its outputs (in a module's attribute or "
                    "in an argument it changed): the recomputation would use the forward's values and their "
                    "gradient would be lost. A Hugging Face model's key/value cache is one: call the model with "
                    "use_cache=False, as its gradient checkpointing does"
                )
        got = _signature(func, args)
        if got is None:
            return
        at, self.checked = self.checked, self.checked + 1
        want = self.forward.signatures[at] if at < len(self.forward.signatures) else (None, ())
        if got != want:
            shapes = lambda sig: ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in sig)  # noqa: E731
            raise RematError(
                f"remat({self.where}): the recomputation ran {got[0]} on ({shapes(got[1])}) where the forward ran "
                f"{want[0]} on ({shapes(want[1])}) (product #{at + 1}): the region must compute the same when it is "
                "recomputed, or its gradients would be wrong. Does it read state that its forward changed? A Hugging "
                "Face model's key/value cache is one: call the model with use_cache=False, as its gradient "
                "checkpointing does"
            )


# Operators that change some of their arguments in place without their schema saying so.
_WRITES_UNMARKED: dict[Any, list[str]] = {
    op: ["running_mean", "running_var"]  # when training
    for op in (aten.native_batch_norm, aten.cudnn_batch_norm, aten.miopen_batch_norm)
}


def _storage(t: torch.Tensor) -> int:
    """Which storage holds a tensor's data, shared by its views (0: none, a tensor subclass)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return 0


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``torch.func``'s wrappers (a vmap's batched outputs): what the
    operators below them, and so this file's dispatch modes, see."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


class _Forward(TorchDispatchMode):
    """Forward of a region: the checked operators' signatures; the tensors it makes from its
    inputs that require grad (held weakly), so that the recomputation can tell when it reads
    one of them (a tensor the forward kept outside its outputs, in state); and a copy of each
    input taken just before the forward first changes it in place (a BatchNorm's running
    statistics; an argument the region writes, ``x += ...``), for the recomputation to start
    from. The first ``state`` inputs are a module's parameters and buffers: of those, only
    the ones needing no gradient are copied (a parameter changed in place is an error the
    step reports itself)."""

    def __init__(self, inputs: Sequence[torch.Tensor], state: int = 0) -> None:
        super().__init__()
        self.signatures: list[Any] = []
        # (by the plain tensor: a vmap hands the region batched ones, its operators see what is under them)
        self.sources = {id(_unwrapped(t)): i for i, t in enumerate(inputs)}
        self.needing = frozenset(i for i, t in enumerate(inputs) if t.requires_grad)
        self.input_storages = {_storage(_unwrapped(t)) for t in inputs}
        # tensors made from inputs, held weakly, with the indices of the inputs they come from
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[int]]] = {}
        self.written: dict[int, frozenset[int]] = {}  # storage -> inputs an in-place write there came from
        self.constants: dict[int, list[tuple[int, torch.Tensor]]] = {}  # storage -> (index, input) copied on write
        for i, t in enumerate(inputs):
            if (i >= state or not t.requires_grad) and (where := _storage(t)):
                self.constants.setdefault(where, []).append((i, t))
        self.before: dict[int, torch.Tensor] = {}  # input index -> its value before the forward changed it

    def copy_before_write(self, func: Any, args: Any, kwargs: Any) -> None:
        unmarked = _WRITES_UNMARKED.get(func.overloadpacket)
        if not self.constants or not (func._schema.is_mutable or unmarked):
            return
        named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | (kwargs or {})
        written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if unmarked and named.get("training"):
            written += unmarked
        for name in written:  # (a write through a view changes the input it views: keyed by storage)
            for t in torch_pytree.tree_leaves(named.get(name)):
                for i, tensor in self.constants.get(_storage(t), []) if isinstance(t, torch.Tensor) else []:
                    if i not in self.before:
                        self.before[i] = tensor.clone()

    def note(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if (signature := _signature(func, args)) is not None:
            self.signatures.append(signature)
        if func is aten.detach.default:  # (a detached copy carries no gradient without remat either)
            return
        tensors = [t for t in torch_pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sources = frozenset().union(*(self.inputs_of(t) for t in tensors))
        if sources:
            for t in torch_pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.made[id(t)] = (weakref.ref(t), sources)
                    if func._schema.is_mutable and (where := _storage(t)):  # written in place: so is every view
                        self.written[where] = self.written.get(where, frozenset()) | sources

    def written_needing_grad(self) -> list[int]:
        """The inputs needing a gradient that the forward changed in place (``x += ...``)."""
        return sorted(i for i in self.before if i in self.needing)

    def carries_grad(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was made by the forward from an input that needs a gradient."""
        entry = self.made.get(id(t))
        return entry is not None and entry[0]() is t and not self.needing.isdisjoint(entry[1])

    def inputs_of(self, t: torch.Tensor) -> frozenset[int]:
        """The indices of the inputs that ``t`` is or was computed from (a data path)."""
        out = self.written.get(_storage(t), frozenset()) if self.written else frozenset()
        if (i := self.sources.get(id(t))) is not None:
            out |= {i}
        entry = self.made.get(id(t))
        return out | entry[1] if entry is not None and entry[0]() is t else out

    def reached(self, outputs: Sequence[torch.Tensor]) -> frozenset[int]:
        """The inputs some output was computed from: those an autograd backward gives a gradient."""
        return frozenset().union(*(self.inputs_of(_unwrapped(t)) for t in outputs))

    def check_nothing_kept(self, outputs: Sequence[torch.Tensor], where: str) -> None:
        """After the forward: no tensor it made from its inputs may outlive it other than its
        outputs (and views of them) and the policy's results. Such a tensor, kept in state (a
        module's attribute, an argument it changed), was made without autograd: a loss reading
        it would silently get no gradient through it. Raises ``RematError``."""
        # (state changed in place in an input, a buffer, is the recomputation's to repeat: as_before)
        keep = {_storage(_unwrapped(t)) for t in (*outputs, *self.policy_results())} | self.input_storages
        left = self._alive_apart_from(keep)
        if left:
            gc.collect()  # (a reference cycle may hold one a while)
            left = self._alive_apart_from(keep)
        if left:
            raise RematError(
                f"remat({where}): the region's forward kept a tensor of shape {list(left[0].shape)} that it made "
                "from its inputs outside its outputs (in a module's attribute, in an argument it changed, such "
                "as a Hugging Face key/value cache, or in a returned object that is neither a pytree nor a "
                "dataclass). A rematerialised forward runs without autograd, so that tensor carries no gradient "
                "and a loss reading it would silently lose it. Return it from the region instead (for a unit: "
                "from its forward); keep its .detach() if it is only looked at (logging); call a Hugging Face "
                "model with use_cache=False, as its gradient checkpointing does, and for the outputs it records "
                "with hooks (output_router_logits, output_attentions) use model.gradient_checkpointing_enable() "
                "instead of remat"
            )

    def _alive_apart_from(self, storages: set[int]) -> list[torch.Tensor]:
        return [
            t
            for ref, sources in self.made.values()
            if not self.needing.isdisjoint(sources) and (t := ref()) is not None and _storage(t) not in storages
        ]

    def policy_results(self) -> list[torch.Tensor]:
        return []


class _Record(_Forward):
    """Forward: keep the outputs of the policy's operators, in the order they ran."""

    def __init__(self, policy: SavePolicy, inputs: Sequence[torch.Tensor], state: int = 0) -> None:
        super().__init__(inputs, state)
        self.policy = policy
        self.kept: list[tuple[Any, Any, tuple[int, ...]]] = []  # (op, output, versions)

    def policy_results(self) -> list[torch.Tensor]:
        return [t for _, out, _ in self.kept for t in torch_pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        self.copy_before_write(func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        self.note(func, args, kwargs, out)
        if self.policy.saves(func) and not func._schema.is_mutable:
            self.kept.append((func, out, _versions(out)))
        return out


class _Replay(_Checked):
    """Recomputation: hand back the kept outputs instead of running those operators again.

    The operators still run through autograd above this mode, so the recomputed graph
    (and its backward) is the forward's exactly. An output modified in place since it was
    kept (its version moved) is recomputed instead.
    """

    def __init__(self, policy: SavePolicy, kept: Sequence[Any], forward: _Forward | None, where: str) -> None:
        super().__init__(forward, where)
        self.policy = policy
        self.kept = list(kept)
        self.taken = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        self.check(func, args, kwargs)
        if self.policy.saves(func) and not func._schema.is_mutable and self.taken < len(self.kept):
            op, out, versions = self.kept[self.taken]
            self.taken += 1
            if op != func:  # (the check above sees every operator; this one only the kept)
                raise RematError(
                    f"remat({self.where}): the recomputation ran {func} where the forward ran {op} (kept result "
                    f"#{self.taken}): the region must run the same operators when it is recomputed"
                )
            if _versions(out) == versions:
                self.replayed.update(id(t) for t in torch_pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
                return out
        return func(*args, **(kwargs or {}))


# --- early stop: what the recomputation may leave out -------------------------------------------

# Operators whose backward reads none of their inputs' or outputs' values (only shapes), and
# those that read some inputs (by position) but not their outputs. Any other operator is
# assumed to read every input and output: leaving out less is always safe.
# Views cost nothing and always run; their order relative to other operators may differ
# between a forward without grad and the recomputation with it (``linear``'s ``t`` and ``view``).
_VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.t.default,
        aten.transpose.int,
        aten.split.Tensor,
        aten.permute.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.slice.Tensor,
        aten.select.int,
        aten.alias.default,
        aten.detach.default,  # plain autograd's recomputation may alias a tensor it saves
    }
)
_READS_NOTHING = _VIEWS | {aten.add.Tensor, aten.sub.Tensor}
_READS_INPUTS = {aten.addmm.default: (1, 2), aten.mm.default: (0, 1)}


@dataclass(frozen=True)
class _Empty:
    """The layout of an operator's output: an uninitialised tensor like it stands in for it."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def like(t: torch.Tensor) -> _Empty:
        return _Empty(t.shape, t.stride(), t.dtype, t.device)

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


class _Trace(_Forward):
    """Forward of a fully rematerialised region: each operator, which earlier operators its
    tensor inputs came from, and its outputs' layout (no tensor is held)."""

    def __init__(self, inputs: Sequence[torch.Tensor], state: int = 0) -> None:
        super().__init__(inputs, state)
        self.ops: list[tuple[Any, list[list[int]], Any]] = []  # (op, producers of each input, output layout)
        self.producer: dict[int, int] = {}  # id(tensor) -> index of the op that made it (the latest with that id)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        self.copy_before_write(func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # metadata queries (fake tensors): not operators of the region
            return out
        inputs = [
            [self.producer[id(t)]] if isinstance(t, torch.Tensor) and id(t) in self.producer else []
            for t in torch_pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        ]
        self.note(func, args, kwargs, out)
        layout = torch_pytree.tree_map_only(torch.Tensor, _Empty.like, out)
        index = len(self.ops)
        self.ops.append((func, inputs, layout))
        for t in torch_pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.producer[id(t)] = index
        return out

    def tail(self) -> tuple[list[tuple[Any, Any]], int]:
        """The region's operators other than views (each with its outputs' layout) and how
        many of them run before the tail whose outputs no backward reads: from there on, the
        recomputation may return empty tensors (torch's early stop); all of them: no such tail."""
        must: set[int] = set()
        for i, (op, inputs, _) in enumerate(self.ops):
            random = torch.Tag.nondeterministic_seeded in op.tags
            if op._schema.is_mutable or random or (op not in _READS_NOTHING and op not in _READS_INPUTS):
                must.add(i)  # reads its outputs (or may): it runs, and so does what feeds it
                must.update(p for ps in inputs for p in ps)
            elif op in _READS_INPUTS:
                must.update(p for k in _READS_INPUTS[op] if k < len(inputs) for p in inputs[k])
        todo = list(must)
        while todo:  # what a running operator reads must run too
            for p in (p for ps in self.ops[todo.pop()][1] for p in ps):
                if p not in must:
                    must.add(p)
                    todo.append(p)
        start = max(must, default=-1) + 1
        kept = [(op, layout) for op, _, layout in self.ops if op not in _VIEWS]
        before = sum(op not in _VIEWS for op, _, _ in self.ops[:start])
        return kept, before


class _SkipTail(_Checked):
    """Recomputation: run the operators up to the tail as the forward did; for the tail,
    whose outputs no backward reads, return empty tensors of the same layout. Views always
    run (counted apart: their order may differ)."""

    def __init__(self, ops: Sequence[tuple[Any, Any]], start: int, forward: _Forward | None, where: str) -> None:
        super().__init__(forward, where)
        self.ops, self.start, self.at, self.same = ops, start, 0, True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        if func in _VIEWS or func.namespace == "prim":  # views; metadata queries (fake tensors)
            return func(*args, **(kwargs or {}))
        self.check(func, args, kwargs)
        at, self.at = self.at, self.at + 1
        expected = self.ops[at][0] if at < len(self.ops) else None
        if at < self.start:
            self.same = self.same and expected == func
            return func(*args, **(kwargs or {}))
        if not self.same:  # lowered to other operators than the forward's (under a transform): skip nothing
            return func(*args, **(kwargs or {}))
        if expected != func:
            raise RematError(
                f"remat({self.where}): the recomputation ran {func} where the forward ran {expected} (operator "
                f"#{at}), after the operators the backward reads: the region must run the same operators when it "
                "is recomputed"
            )
        return torch_pytree.tree_map_only(_Empty, _Empty.make, self.ops[at][1])


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


def _versions(out: Any) -> tuple[int, ...]:
    return tuple(t._version for t in torch_pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


# --- the rematerialising function ------------------------------------------------------------------


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


# --- modules: their parameters and buffers as inputs of the region ---------------------------------


def _state_slots(modules: Sequence[nn.Module]) -> tuple[list[torch.Tensor], list[list[tuple[nn.Module, str, bool]]]]:
    """The modules' current parameter and buffer tensors (each once) and where each one sits."""
    tensors: list[torch.Tensor] = []
    slots: list[list[tuple[nn.Module, str, bool]]] = []
    index: dict[int, int] = {}
    seen: set[tuple[int, str]] = set()
    for root in modules:
        for m in root.modules():
            for table, is_param in ((m._parameters, True), (m._buffers, False)):
                for attr, t in table.items():
                    # a stand-in for a parameter that is not there (another unit's, not gathered)
                    if not isinstance(t, torch.Tensor) or isinstance(t, StandIn) or (id(m), attr) in seen:
                        continue
                    seen.add((id(m), attr))
                    k = index.setdefault(id(t), len(tensors))
                    if k == len(tensors):
                        tensors.append(t)
                        slots.append([])
                    slots[k].append((m, attr, is_param))
    return tensors, slots


@contextlib.contextmanager
def _installed(slots: list[list[tuple[nn.Module, str, bool]]], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The modules' parameters and buffers are ``tensors`` for the block (restored after it)."""
    previous: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for places, t in zip(slots, tensors, strict=True):
            for m, attr, is_param in places:
                table: dict[str, Any] = m._parameters if is_param else m._buffers
                previous.append((table, attr, table[attr]))
                table[attr] = t
        yield
    finally:
        for table, attr, old in reversed(previous):
            table[attr] = old


def _remat_with_state(
    fn: Callable[..., Any], modules: Sequence[nn.Module], policy: SavePolicy, where: str
) -> Callable[..., Any]:
    """``remat(fn)`` where the parameters and buffers of ``modules`` (read at each call) are inputs too."""

    def region(state: list[torch.Tensor], slots: _Opaque, *args: Any, **kwargs: Any) -> Any:
        with _installed(slots.value, state):
            return fn(*args, **kwargs)

    region.__qualname__ = where
    inner = _rematerialised(region, policy, where, state=lambda state, *_: len(state))

    @functools.wraps(fn)
    def rematerialised(*args: Any, **kwargs: Any) -> Any:
        state, slots = _state_slots(modules)
        return inner(state, _Opaque(slots), *args, **kwargs)

    return rematerialised


class _Opaque:
    """A value pytrees treat as one constant leaf (the module slots must not be flattened)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# --- which units a train step rematerialises ---------------------------------------------------------


@dataclass(frozen=True)
class Remat:
    """Which units a train step rematerialises, and what their forward keeps.

    ``units``: ``True`` for every non-root unit, or a policy with the auto-wrap signature
    ``(module, recurse, unwrapped_params, **kw) -> bool`` asked once per unit with
    ``recurse=False`` and the unit's parameter count. Lookups are never selected (a plain
    ``nn.Embedding`` saves only its indices: recomputing it saves nothing and would gather
    its table again in backward). ``policy``: the ``SavePolicy``.
    ``every``: of the selected units, in module order, rematerialise the first and then
    every ``every``-th (Hugging Face's ``every_n_layers``).
    """

    units: bool | Policy = True
    policy: SavePolicy = save_nothing
    every: int = 1

    def __post_init__(self) -> None:
        if self.units is not True and (isinstance(self.units, bool) or not callable(self.units)):
            raise TypeError(
                f"Remat.units must be True (every non-root unit) or a policy callable as "
                f"policy(module, recurse, unwrapped_params), got {self.units!r}; for no remat pass remat=None"
            )
        if not isinstance(self.policy, SavePolicy):
            raise TypeError(f"Remat.policy must be a SavePolicy (save_nothing, save_dots, ...), got {self.policy!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Remat.every must be a positive int, got {self.every!r}")

    @classmethod
    def of(cls, value: bool | Policy | Remat | None) -> Remat | None:
        """What ``train_step(remat=value)`` means: ``None``/``False`` none, ``True`` every
        non-root unit, a unit policy, or a ``Remat``."""
        if value is None or value is False:
            return None
        if isinstance(value, Remat):
            return value
        if value is True or callable(value):
            return cls(units=value)
        raise TypeError(
            f"remat must be None, True, a unit policy callable as policy(module, recurse, unwrapped_params), "
            f"or a Remat, got {type(value).__name__} {value!r}"
        )

    def selects(self, plan: Plan, module: nn.Module) -> frozenset[str]:
        """The names of the units to rematerialise (no communication, no allocation).

        Candidates are the non-root units named after a module (a shared tied parameter's
        own unit has no forward of its own) that are no lookup (``Unit.lookup``: nothing to
        recompute); a unit inside another selected unit is left out, since recomputing the
        outer one recomputes it.
        """
        chosen = []
        for unit in plan.units:
            if unit.name == ROOT or unit.hooks or unit.lookup:
                continue
            try:
                sub = module.get_submodule(unit.name)
            except AttributeError as e:
                raise ValueError(
                    f"Remat: unit {unit_label(unit.name)} is not a submodule of {type(module).__name__}: "
                    "was the plan made for another model?"
                ) from e
            if not isinstance(self.units, bool):
                answer = self.units(sub, False, unit.numel + unit.frozen_part.numel)
                if not isinstance(answer, bool):
                    raise TypeError(
                        f"Remat unit policy {getattr(self.units, '__qualname__', self.units)!r} returned "
                        f"{type(answer).__name__} {answer!r} for unit {unit_label(unit.name)}; it must return a bool"
                    )
                if not answer:
                    continue
            chosen.append(unit.name)
        outer = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen)]
        return frozenset(outer[:: self.every])


# --- torch.utils.checkpoint, routed ------------------------------------------------------------------

_route_lock = threading.Lock()
_route_depth = 0
_route_saved: list[tuple[Any, str, Any]] = []
_MISSING = object()


def _modules_in(fn: Any, depth: int = 0) -> list[nn.Module]:
    """Modules ``fn`` reaches directly: itself, a bound method's owner, a partial's
    arguments, a closure's cells (a few levels deep)."""
    if depth > 4:
        return []
    if isinstance(fn, nn.Module):
        return [fn]
    found: list[nn.Module] = []
    if isinstance(fn, functools.partial):
        for x in (fn.func, *fn.args, *fn.keywords.values()):
            found += _modules_in(x, depth + 1)
    elif isinstance(fn, types.MethodType):
        found += _modules_in(fn.__self__, depth + 1) + _modules_in(fn.__func__, depth + 1)
    elif isinstance(fn, types.FunctionType):
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                found += _modules_in(cell.cell_contents, depth + 1)
    return list({id(m): m for m in found}.values())


def _routed_checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Any = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint``'s signature; runs ``function`` through ``remat``."""
    kwargs.pop("preserve_rng_state", None)  # remat always replays the generators
    name = _describe(function)
    if use_reentrant is not False and kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    if (context_fn is not None and context_fn is not torch_checkpoint.noop_context_fn) or debug:
        raise RematError(
            f"torch.utils.checkpoint.checkpoint({name}, context_fn=..., debug=...) cannot be routed to "
            "fsdp_fn.remat (its saved-tensor machinery does not run inside torch.func); "
            "for selective checkpointing use fsdp_fn.remat(fn, policy=fsdp_fn.save_dots) or "
            "train_step(remat=fsdp_fn.Remat(policy=fsdp_fn.save_dots))"
        )
    # A partial's bound arguments become the region's arguments, so its tensors are inputs too.
    while isinstance(function, functools.partial):
        args, kwargs = (*function.args, *args), {**function.keywords, **kwargs}
        function = function.func
    modules = _modules_in(function) + [m for x in (*args, *kwargs.values()) for m in _modules_in(x)]
    modules = list({id(m): m for m in modules}.values())
    for handler in reversed(_region_handlers):
        out = handler(function, modules, args, kwargs)
        if out is not NotImplemented:
            return out
    return _remat_with_state(function, modules, save_nothing, name)(*args, **kwargs)


RegionHandler = Callable[[Callable[..., Any], list[nn.Module], tuple[Any, ...], dict[str, Any]], Any]
_region_handlers: list[RegionHandler] = []


@contextlib.contextmanager
def handling_regions(handler: RegionHandler) -> Iterator[None]:
    """For the block, a routed checkpoint region is first offered to ``handler(function,
    modules, args, kwargs)``; it returns the region's result, or ``NotImplemented`` to
    leave the region to ``remat``. (fsdp_fn's runtime takes regions that are units.)"""
    _region_handlers.append(handler)
    try:
        yield
    finally:
        _region_handlers.remove(handler)


class _RoutedCheckpointFunction:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (the reentrant variant)."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return _routed_checkpoint(function, *args, use_reentrant=True)


def _refusing(what: str) -> Callable[..., Iterator[None]]:
    """Stands in for torch's non-reentrant checkpoint generator where it cannot be routed."""

    def refused(fn: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        raise RematError(
            f"{what} of {_describe(fn)} relies on saved-tensor hooks, which torch.func refuses; "
            "use fsdp_fn.remat (train_step(remat=...) for units, fsdp_fn.remat(module) for any module) "
            "or call torch.utils.checkpoint.checkpoint, which is routed to it"
        )
        yield  # a generator, like the function it stands in for

    return refused


def _patches() -> list[tuple[Any, str, Any]]:
    public = torch_checkpoint.checkpoint
    original = getattr(public, "__wrapped__", None)
    # torch wraps checkpoint in _disable_dynamo, whose wrapper looks the function to call up as
    # this attribute at call time: setting it reaches every reference to checkpoint, including
    # functools.partial objects made before (Hugging Face's gradient_checkpointing_enable).
    if original is None or "__dynamo_disable" not in public.__code__.co_consts:
        raise RematError(
            "fsdp_fn cannot route torch.utils.checkpoint.checkpoint in this torch version "
            f"({torch.__version__}); wrap the region with fsdp_fn.remat instead"
        )
    patches = [
        (original, "__dynamo_disable", _routed_checkpoint),
        (torch_checkpoint, "CheckpointFunction", _RoutedCheckpointFunction),
        (
            torch_checkpoint,
            "_checkpoint_without_reentrant_generator",
            _refusing("torch.utils.checkpoint's non-reentrant generator"),
        ),
    ]
    # torch.distributed._composable.checkpoint(module) enters that generator from module hooks,
    # around a forward it cannot replace: not routable, refused by name (when it is loaded at all).
    composable = sys.modules.get("torch.distributed._composable.checkpoint_activation")
    if composable is not None and hasattr(composable, "_checkpoint_without_reentrant_generator"):
        refused = _refusing("torch.distributed._composable.checkpoint")
        patches.append((composable, "_checkpoint_without_reentrant_generator", refused))
    return patches


@contextlib.contextmanager
def route_torch_checkpoint() -> Iterator[None]:
    """For the block, ``torch.utils.checkpoint.checkpoint`` (reentrant or not) runs its
    function through ``fsdp_fn.remat``, so models that checkpoint run inside ``torch.func``.

    Gradients equal those without checkpointing. The parameters and buffers of the modules
    the checkpointed function reaches (a module, a bound method's owner, a partial's
    arguments, closure cells) become inputs of the region, so they get gradients.
    ``context_fn`` and ``debug`` are refused with an error, and so is
    ``torch.distributed._composable.checkpoint`` (its hooks cannot hand the forward
    over). Restored on exit, also on an
    exception. Thread safety: the patch is process-wide; nested and concurrent blocks
    share it (the first entry installs it, the last exit removes it), so a thread that
    checkpoints outside fsdp_fn meanwhile is routed too, which is still exact.
    """
    global _route_depth
    with _route_lock:
        if _route_depth == 0:
            patches = _patches()
            for owner, attr, value in patches:
                _route_saved.append((owner, attr, getattr(owner, attr, _MISSING)))
                setattr(owner, attr, value)
        _route_depth += 1
    try:
        yield
    finally:
        with _route_lock:
            _route_depth -= 1
            if _route_depth == 0:
                while _route_saved:
                    owner, attr, old = _route_saved.pop()
                    if old is _MISSING:
                        delattr(owner, attr)
                    else:
                        setattr(owner, attr, old)
