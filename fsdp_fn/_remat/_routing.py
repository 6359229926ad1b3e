"""``torch.utils.checkpoint`` routed through ``remat``, so models that checkpoint run inside ``torch.func``.

The patch is process-wide (torch's module attributes): the first ``route_torch_checkpoint()``
block to enter installs it, the last to leave removes it, under one lock.

>>> f = lambda x: torch_checkpoint.checkpoint(torch.tanh, x, use_reentrant=False).sum()
>>> with route_torch_checkpoint():    # torch.func refuses torch's own checkpoint
...     torch.func.grad(f)(torch.zeros(3))
tensor([1., 1., 1.])
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from fsdp_fn._remat._errors import RematError
from fsdp_fn._remat._function import _describe, _remat_with_state
from fsdp_fn._remat._policies import save_nothing

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
    arguments, closure cells) become inputs of the region, so they get gradients; inside
    fsdp_fn's calls the units inside those modules do too (by their shards: the region's
    forward gathers them, and so does its recomputation).
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
