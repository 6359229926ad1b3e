"""``apply_sharded``: the module run over shards with differentiable gathers, for every transform.

``ComposableRuntime`` is a ``Runtime`` (``_runtime.py``) whose units' forwards gather with the
differentiable all-gather of ``gather_for`` (``_gather.py``): its backward is the
reduce-scatter and its tangent and batching rules are the collective's own, so ``grad``,
``vjp``, ``jvp``, ``vmap`` and grad of grad compose, as does plain ``.backward()`` on shards
that require grad. Gathered units stay alive as long as autograd holds them: no lifecycle,
no prefetch. ``value_and_grad`` runs it inside another ``torch.func`` transform.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fsdp_fn._collectives import all_gather
from fsdp_fn._functional import Functional
from fsdp_fn._gather import gather_differentiably
from fsdp_fn._plan import Unit
from fsdp_fn._policy import Schedule
from fsdp_fn._remat import Remat
from fsdp_fn._runtime import Runtime
from fsdp_fn._shard import Sharded, shards_of, unit_views
from fsdp_fn._unit import GatheredUnit


class ComposableRuntime(Runtime):
    """A call over shards whose gathers are differentiable all-gathers (any transform composes)."""

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        *,
        schedule: Schedule | None = None,
        remat: Remat | None = None,
        check_unchanged: bool = False,
    ) -> None:
        super().__init__(fn, params, schedule=schedule, remat=remat, check_unchanged=check_unchanged, composable=True)

    def _gather(self, unit: Unit) -> tuple[GatheredUnit | None, dict[str, torch.Tensor]]:
        self.uses[unit.name] = self.uses.get(unit.name, 0) + 1
        layout = self.params.layout
        out: dict[str, torch.Tensor] = {}
        for part, shard in shards_of(self.params, unit):
            if part is unit:  # (a region's own input, inside a region that gathers the unit)
                shard = self._shard_for(unit)
            source = shard.to(dtype=self.schedule.gather_dtype(part.dtype), device=self.device or shard.device)
            if part is unit:
                full = gather_differentiably(source, layout, unit.name)
            else:  # frozen: a constant
                with torch.no_grad():
                    full = all_gather(source.detach(), layout.group, unit=unit.name)
            views = unit_views(part, full)
            if part is unit and torch.is_grad_enabled() and torch._C._functorch.maybe_current_level() is None:
                for name in self.wiring.sparse_grads & views.keys():
                    views[name] = _DenseGrad.apply(views[name])
            out.update(views)
        return None, out


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes a sparse gradient dense: autograd cannot reshape a sparse
    gradient into the unit's flat one. Memory: the parameter's dense gradient, as for any other."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad if grad.layout == torch.strided else grad.to_dense()


def apply_sharded(
    fn: Functional, params: Sharded, buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any
) -> Any:
    """Compute ``fn(full_params, buffers, *args, **kwargs)`` from sharded ``params``.

    Each unit is all-gathered just before its module runs, by the differentiable
    all-gather of ``gather_for``: the gradient with respect to ``params`` is the
    reduce-scattered (rank-averaged) gradient, and every ``torch.func`` transform composes
    (``grad``, ``vjp``, ``jvp``, ``vmap``, grad of grad) as does plain ``.backward()`` when
    the shards require grad. Memory: shards plus every unit gathered so far (autograd keeps
    them for the backward; the train step's own pass frees them instead); communication:
    one all-gather per unit use in forward, one reduce-scatter per use in backward.

    Args:
        fn: the model, from ``functionalize(module)``.
        params: the sharded parameters (``shard``); the plan they were made for must
            describe ``fn``'s module.
        buffers: the module's buffers by name (``fn.buffers``), full on every rank.
        *args: positional arguments of the module's forward.
        **kwargs: keyword arguments of the module's forward.

    Returns:
        What the module's forward returns, differentiable with respect to ``params``.

    Raises:
        RuntimeError: if ``params`` was donated to a train step or left half-updated by a
            failed one, or a unit's forward changed its gathered parameters in place.
        ValueError: if ``params`` was made for another plan (a parameter's name or shape
            differs from ``fn``'s module), or a shard has the wrong length for the world size.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from fsdp_fn import functionalize, make_plan, shard
        >>> m = nn.Linear(3, 2)
        >>> fn = functionalize(m)
        >>> params = shard(fn.params, make_plan(m))
        >>> x = torch.ones(4, 3)
        >>> torch.allclose(apply_sharded(fn, params, fn.buffers, x), m(x))
        True
    """
    return ComposableRuntime(fn, params).run(buffers, *args, **kwargs)
