"""A plain ``nn.Module`` as a pure function over pytrees of parameters and buffers."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call


@dataclass(frozen=True, eq=False)
class Functional:
    """The module's forward as a pure function: ``apply(params, buffers, *args, **kwargs)``.

    ``params`` and ``buffers`` are dicts keyed by fully-qualified name (tied parameters
    appear once, under their first name). ``params`` are detached views of the module's
    own parameters (no copy); ``buffers`` are copies, so running ``apply`` never writes
    into the module (e.g. BatchNorm statistics update the copies).

    Attributes:
        module: the module, unchanged (same class, same parameter objects).
        params: detached views of its parameters by fully-qualified name.
        buffers: copies of its buffers by fully-qualified name.
    """

    module: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]

    def __call__(
        self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any
    ) -> Any:
        """Run the module's forward with ``params`` and ``buffers`` in place of its own.

        ``torch.func.functional_call`` with tied weights kept tied; the module's own
        parameters and buffers are put back afterwards. Memory and communication: the
        forward's own (any tensor of ``params`` is used as it is, without a copy).

        Args:
            params: parameters by fully-qualified name (full, not sharded); a name left out
                uses the module's own.
            buffers: buffers by fully-qualified name; a forward that updates a buffer in
                place (BatchNorm) writes into these.
            *args: positional arguments of the module's forward.
            **kwargs: keyword arguments of the module's forward.

        Returns:
            What the module's forward returns.
        """
        with parameters_restored(self.module):
            return functional_call(self.module, {**params, **buffers}, args, kwargs, tie_weights=True, strict=False)

    apply = __call__


class ModuleIndex:
    """Every submodule of a module and every slot a parameter or buffer sits in, found once
    (``index_of``): a step reads them each call, and walking the module tree each time was a
    good part of a small model's step. The module's structure is taken as fixed once it is
    functionalised (the plan describes it); the tensors in the slots are read live."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = list(module.modules())
        owners = dict(module.named_modules(remove_duplicate=False))
        # (full name, owner, attribute) for each name of each parameter, tied aliases included.
        self.param_slots: list[tuple[str, nn.Module, str]] = []
        for name, _ in module.named_parameters(remove_duplicate=False):
            prefix, _, attr = name.rpartition(".")
            self.param_slots.append((name, owners[prefix], attr))
        self.buffer_slots: list[tuple[str, nn.Module, str]] = []
        for name, _ in module.named_buffers(remove_duplicate=False):
            prefix, _, attr = name.rpartition(".")
            self.buffer_slots.append((name, owners[prefix], attr))

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``module.named_parameters()``: each parameter once, under its first name."""
        seen: set[int] = set()
        for name, owner, attr in self.param_slots:
            p = owner._parameters.get(attr)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield name, p


_indexes: weakref.WeakKeyDictionary[nn.Module, ModuleIndex] = weakref.WeakKeyDictionary()


def index_of(module: nn.Module) -> ModuleIndex:
    """``module``'s ``ModuleIndex``, made at the first call."""
    index = _indexes.get(module)
    if index is None:
        index = _indexes[module] = ModuleIndex(module)
    return index


_ABSENT = object()


@contextlib.contextmanager
def entries_set(entries: Iterable[tuple[dict[str, Any], str, Any]]) -> Iterator[None]:
    """Each ``table[key] = value`` for the block, the old entries put back after it in reverse
    order (a key that was absent removed again), also on an exception: the one patch-and-restore
    of a module's ``_parameters``, ``_buffers`` or instance ``__dict__``."""
    previous: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for table, key, value in entries:
            previous.append((table, key, table.get(key, _ABSENT)))
            table[key] = value
        yield
    finally:
        for table, key, old in reversed(previous):
            if old is _ABSENT:
                del table[key]
            else:
                table[key] = old


@contextlib.contextmanager
def parameters_restored(module: nn.Module) -> Iterator[None]:
    """Put every parameter and buffer of ``module`` back as it was when the block ends.

    ``functional_call`` restores them itself, except when one module is reachable by two
    paths (a module shared by two blocks): it swaps the same attribute twice and restores
    the second swap's value, leaving the module changed.
    """
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in index_of(module).modules]
    try:
        yield
    finally:
        for m, params, buffers in saved:
            m._parameters.update(params)
            m._buffers.update(buffers)


def functionalize(module: nn.Module) -> Functional:
    """Turn ``module`` into a pure function and its parameter/buffer pytrees.

    The module is not changed: same class, same ``state_dict()``, same parameter objects.
    Memory: no parameter is copied; buffers are cloned. No communication.

    Args:
        module: any ``nn.Module``; it is not wrapped nor subclassed.

    Returns:
        The ``Functional``: the pure function, with the parameters (detached views) and
        buffers (copies) by fully-qualified name.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.

    Examples:
        >>> from torch import nn
        >>> import torch
        >>> fn = functionalize(nn.Linear(3, 2))
        >>> sorted(fn.params)
        ['bias', 'weight']
        >>> fn(fn.params, fn.buffers, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize wants an nn.Module, got {type(module).__name__}")
    params = {name: p.detach() for name, p in module.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return Functional(module, params, buffers)


_original_requires_grad_ = torch.Tensor.requires_grad_


def _requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    # Inside a torch.func transform the transform decides what is differentiated (the
    # shards); asking a tensor to require grad is then a no-op instead of an error.
    # Hugging Face models do it on their embeddings' output when checkpointing is on.
    if requires_grad and torch._C._functorch.maybe_current_level() is not None:
        return self
    return _original_requires_grad_(self, requires_grad)


@contextlib.contextmanager
def requires_grad_tolerated() -> Iterator[None]:
    """For the block, ``tensor.requires_grad_(True)`` inside a ``torch.func`` transform returns the
    tensor unchanged (torch raises there). Process-wide while the block runs."""
    torch.Tensor.requires_grad_ = _requires_grad_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.requires_grad_ = _original_requires_grad_  # type: ignore[method-assign]
