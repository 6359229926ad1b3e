"""Stand-ins for parameters that must not be read where they are: any use raises, naming them.

Two places need one: a unit's parameter outside that unit's forward (its values exist only
while the unit is gathered), and the module's own parameters while a ``loss_fn`` runs (the
trained values live in the shards; the module keeps its originals, and a gradient to those
would be dropped without a word). A stand-in owns no memory.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from fsdp_fn._functional import index_of

# Reading what a tensor is (shape, dtype, device, requires_grad) is harmless; its values are not.
_HARMLESS = {
    "__get__",
    "size",
    "dim",
    "__repr__",
    "__format__",
    "numel",
    "nelement",
    "ndimension",
    "element_size",
    "is_floating_point",
    "is_complex",
    "get_device",
}


class StandIn(torch.Tensor):
    """A parameter's shape, dtype and device without its values: any use of the values raises
    ``RuntimeError(message)``, with ``{op}`` in the message replaced by the operation.

    >>> import torch
    >>> w = StandIn(torch.Size([2, 3]), torch.float32, torch.device("meta"), "w is not here ({op})")
    >>> w.shape, w.dtype
    (torch.Size([2, 3]), torch.float32)
    >>> w.sum()
    Traceback (most recent call last):
    ...
    RuntimeError: w is not here (sum)
    """

    fsdp_fn_message: str

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        message: str,
        requires_grad: bool = False,
    ) -> StandIn:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t.fsdp_fn_message = message
        return t  # type: ignore[no-any-return]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(_message(args, kwargs, name))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(_message(args, kwargs, str(func)))


def _message(args: Any, kwargs: Any, op: str) -> str:
    me = next(a for a in torch_pytree.tree_leaves((args, kwargs)) if isinstance(a, StandIn))
    return me.fsdp_fn_message.replace("{op}", op)


# module -> id(parameter) -> (the parameter, its stand-in, its requires_grad when the stand-in was made)
_hidden: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[torch.Tensor, StandIn, bool]]]
_hidden = weakref.WeakKeyDictionary()


def _standin_for(p: torch.Tensor, name: str) -> StandIn:
    return StandIn(
        p.shape,
        p.dtype,
        p.device,
        f"loss_fn read parameter {name!r} of the module itself ({{op}}); during a step the "
        "module keeps its original values, not the trained shards, and a gradient to them would be "
        "lost. Reach the model only through model(...), loss_fn's first argument; a term on a unit's "
        "parameters belongs in that unit's forward, and an L2 penalty is the optimizer's weight decay "
        "(sgd(weight_decay=...), from_torch(torch.optim.Adam(..., weight_decay=...)))",
        requires_grad=p.requires_grad,
    )


@contextlib.contextmanager
def module_parameters_hidden(module: nn.Module) -> Iterator[None]:
    """While the block runs, each parameter of ``module`` is a ``StandIn`` that names it.

    For a ``loss_fn``: it reaches the model through ``model(...)``, which runs the module on
    the shards. Reading the module's own parameters there would see their original values
    and lose their gradient silently. Tied parameters share one stand-in, so
    ``functional_call`` still sees the tie. No memory, no communication.
    """
    index = index_of(module)
    standins = _hidden.setdefault(module, {})
    saved = [(m, dict(m._parameters)) for m in index.modules]
    for name, owner, attr in index.param_slots:
        p = owner._parameters.get(attr)
        if p is None or isinstance(p, StandIn):
            continue
        known = standins.get(id(p))
        if known is None or known[0] is not p or known[2] != p.requires_grad:  # (made once)
            known = standins[id(p)] = (p, _standin_for(p, name), p.requires_grad)
        owner._parameters[attr] = known[1]  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, params in saved:
            m._parameters.update(params)
