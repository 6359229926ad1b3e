"""The dispatch modes a region runs under: its forward recorded, its recomputation checked against it and replayed.

``_Forward`` sees every operator of the forward: the products' signatures, which tensors came
from which inputs (held weakly), inputs copied before the forward first changes them in place.
``_Record`` also keeps the saving policy's results; ``_Replay`` hands them back to the
recomputation, which ``_Checked`` holds to the forward (same products on the same shapes,
no tensor the forward kept in state).

>>> x = torch.ones(2, 2)
>>> with _Record(SavePolicy("products", frozenset({aten.mm})), [x]) as record:
...     y = torch.tanh(x @ x)
>>> [op for op, _, _ in record.kept]   # kept for the recomputation: the product, not the tanh
[<OpOverload(op='aten.mm', overload='default')>]
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_fn._remat._errors import RematError
from fsdp_fn._remat._policies import SavePolicy

aten = torch.ops.aten


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
        # tensors computed from inputs out of this mode's sight (``derive``), held weakly: a data path
        # only, never a tensor the forward kept
        self.derived: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[int]]] = {}

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
        for known in (self.made, self.derived):
            entry = known.get(id(t))
            if entry is not None and entry[0]() is t:
                out |= entry[1]
        return out

    def derive(self, tensors: Sequence[torch.Tensor], source: torch.Tensor) -> None:
        """``tensors`` were computed from ``source`` where this mode did not see it (a unit's
        all-gather, run outside the region's modes): its outputs reach the inputs ``source`` does."""
        sources = self.inputs_of(_unwrapped(source))
        for t in tensors:
            t = _unwrapped(t)
            self.derived[id(t)] = (weakref.ref(t), sources)

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
        for pause in (0.0, 0.001, 0.01, 0.05, 0.2):
            if not left:
                break
            # A reference cycle may hold one a while; so may a backend's communication thread, which
            # lets go of a collective's tensors just after it says the collective is done (gloo's
            # all-reduce inside a region: the tensor-parallel sum), later when the cores are busy.
            # Only a region that seems to keep one waits (at most a quarter of a second).
            time.sleep(pause)
            gc.collect()
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


def _versions(out: Any) -> tuple[int, ...]:
    return tuple(t._version for t in torch_pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
