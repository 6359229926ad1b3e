"""``autograd.Function.apply`` without its Python preamble, for the train step's own pass; a
tensor under ``torch.func``'s wrappers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any ``torch.func`` wrappers (shares storage with ``t``).

    >>> x = torch.ones(2)
    >>> plain(x) is x
    True
    """
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def plain_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply``, taking autograd's C++ path directly when no ``torch.func`` transform is active.

    ``Function.apply`` binds its arguments with ``inspect.signature`` at every call when the
    class has a ``setup_context`` (which ``torch.func`` needs): ~5% of a step whose math is
    small, with a function per parameter. Outside every transform an old-style twin of
    ``cls`` (``forward(ctx, ...)`` running ``cls.forward`` then ``cls.setup_context``, the same
    ``backward``, the same name) is applied instead; inside one, ``cls.apply`` as it is.

    >>> class Double(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(x):
    ...         return 2 * x
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         pass
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return 2 * grad
    >>> double = plain_apply(Double)
    >>> x = torch.ones(2, requires_grad=True)
    >>> double(x).grad_fn.name()  # the same name as Double.apply's node
    'DoubleBackward'
    >>> torch.func.grad(lambda t: double(t).sum())(torch.ones(2))  # under a transform: Double.apply
    tensor([2., 2.])
    """

    def forward(ctx: Any, *inputs: Any) -> Any:
        output = cls.forward(*inputs)
        cls.setup_context(ctx, inputs, output)
        return output

    twin = type(cls.__name__, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": cls.backward})
    c_apply = super(torch.autograd.Function, twin).apply  # type: ignore[misc]
    active = torch._C._are_functorch_transforms_active
    general = cls.apply

    def apply(*args: Any) -> Any:
        return general(*args) if active() else c_apply(*args)

    return apply


class plain_mode:
    """``torch._C._DisableFuncTorch()`` and ``torch.no_grad()`` at once: plain tensors, no
    autograd history; for the step's own copies and collectives, at a third of the two's cost.

    >>> x = torch.ones(2, requires_grad=True)
    >>> with plain_mode():
    ...     y = x * 2
    >>> y.requires_grad, torch.is_grad_enabled()
    (False, True)
    """

    __slots__ = ("functorch", "grad")

    def __enter__(self) -> None:
        self.functorch = torch._C._DisableFuncTorch()
        self.functorch.__enter__()
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.grad)
        self.functorch.__exit__(*exc)
