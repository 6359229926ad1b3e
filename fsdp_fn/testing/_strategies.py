"""What a property test draws: models, unit policies, world sizes and layouts, as specs a rank can rebuild.

A spec (``ModelSpec``, ``PlanSpec``, ``LayoutSpec``) is a small frozen value sent to every rank;
``build()``, ``make(module)`` and ``group()`` make the same module, plan and group on each.

>>> spec = ModelSpec((3, 5, 3))
>>> [tuple(p.shape) for p in spec.build().parameters()]
[(5, 3), (5,), (3, 5), (3,)]
>>> [unit.name for unit in PlanSpec("layers").make(spec.build()).units]
['layers.0', 'layers.1']
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_fn._plan import Plan, Policy, layer_policy, make_plan, size_policy
from fsdp_fn.testing._pool import _groups, pool_group

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy


class StackMLP(nn.Module):
    """Linear layers with ``tanh`` between them; the test model the strategies draw.

    ``tied``: the last layer uses the first layer's weight (same ``Parameter``), so
    ``widths`` must end as they start (``(a, b, ..., a, b)``). ``frozen``: indices of
    layers whose parameters do not require grad.
    """

    def __init__(self, widths: Sequence[int], *, tied: bool = False, frozen: Sequence[int] = ()) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ValueError(f"StackMLP needs at least two widths (one layer), got {tuple(widths)}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        if tied:
            first, last = self.layers[0], self.layers[-1]
            if len(self.layers) < 2 or first.weight.shape != last.weight.shape:
                raise ValueError(f"tied=True needs widths that end as they start (a, b, ..., a, b), got {widths}")
            last.weight = first.weight
        for i in frozen:
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


@dataclass(frozen=True)
class ModelSpec:
    """A drawn model, small enough to send to ranks: ``build()`` makes the same module on every rank.

    Args:
        widths: the ``StackMLP``'s widths, input first (one layer per pair).
        tied: whether the last layer uses the first layer's weight.
        frozen: indices of the layers whose parameters do not require grad.
        seed: the seed the parameters are drawn with.
        dtype: the parameters' dtype, and the batches'.
    """

    widths: tuple[int, ...]
    tied: bool = False
    frozen: tuple[int, ...] = ()
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def build(self) -> StackMLP:
        """The model, the same on every rank (it seeds the global generator with ``seed``).

        Returns:
            A new ``StackMLP`` in ``dtype``.

        Raises:
            ValueError: if the widths make no layer, or ``tied`` widths do not end as they
                start.
        """
        torch.manual_seed(self.seed)
        return StackMLP(self.widths, tied=self.tied, frozen=self.frozen).to(self.dtype)

    def batch(self, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and regression targets, the same on every rank for the same ``seed``.

        Drawn from a generator of its own: the global one is left as it was.

        Args:
            size: how many examples (the global batch; ``split_batch`` parts it).
            seed: the seed of the draw.

        Returns:
            The inputs, ``(size, widths[0])``, and the targets, ``(size, widths[-1])``, in
            the spec's dtype.

        Examples:
            >>> x, y = ModelSpec((3, 5, 2)).batch(4)
            >>> tuple(x.shape), tuple(y.shape)
            ((4, 3), (4, 2))
        """
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(size, self.widths[0], generator=g, dtype=self.dtype)
        return x, torch.randn(size, self.widths[-1], generator=g, dtype=self.dtype)


@dataclass(frozen=True)
class PlanSpec:
    """A drawn unit policy: ``"whole"`` (one root unit), ``"layers"`` (a unit per ``nn.Linear``)
    or ``"size"`` (``size_policy(min_num_params)``); ``split_root`` as in ``make_plan``;
    ``grouped`` consecutive units merged into one (``Plan.grouped``).

    Args:
        policy: ``"whole"``, ``"layers"`` or ``"size"``.
        min_num_params: the size policy's threshold (for ``"size"``).
        split_root: whether to shard the root like any other unit, as in ``make_plan``.
        grouped: units per merged unit (1: none merged).
    """

    policy: str = "layers"
    min_num_params: int = 1
    split_root: bool = False
    grouped: int = 1

    def make(self, module: nn.Module) -> Plan:
        """The plan of ``module`` under this policy (``make_plan``: reads shapes only).

        Args:
            module: the model, e.g. ``ModelSpec.build()``'s.

        Returns:
            The ``Plan``, the same on every rank.

        Raises:
            KeyError: if ``policy`` is not ``"whole"``, ``"layers"`` or ``"size"``.
            ValueError: what ``make_plan`` raises (``"layers"`` on a model without an
                ``nn.Linear``, say).
        """
        policies: dict[str, Policy | None] = {
            "whole": None,
            "layers": layer_policy([nn.Linear]),
            "size": size_policy(self.min_num_params),
        }
        return make_plan(module, policies[self.policy], split_root=self.split_root).grouped(self.grouped)


@dataclass(frozen=True)
class LayoutSpec:
    """``world`` ranks, as ``replicas`` replicas of ``world // replicas`` shards each (hybrid
    sharding when ``replicas > 1``)."""

    world: int
    replicas: int = 1

    def group(self) -> Any:
        """Inside a pool rank: what to pass to ``shard`` (a group, or a 2-D mesh for hybrid sharding).

        A mesh spans the default group, so ``replicas > 1`` needs ``world`` to be the pool's size.
        """
        if self.replicas == 1:
            return pool_group(self.world)
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world:
            raise ValueError(
                f"a hybrid layout spans every rank: world={self.world}, default group has {dist.get_world_size()}"
            )
        key = -self.replicas
        if key not in _groups:
            _groups[key] = init_device_mesh(
                "cpu", (self.replicas, self.world // self.replicas), mesh_dim_names=("replicate", "shard")
            )
        return _groups[key]


def _odd_widths(max_world: int) -> list[int]:
    return [w for w in range(1, 12) if all(w % k for k in range(2, max_world + 1))]


def models(
    *, depth: tuple[int, int] = (1, 3), max_world: int = 4, tied: bool | None = None, frozen: bool = True
) -> SearchStrategy[ModelSpec]:
    """``ModelSpec``s of ``depth`` layers whose widths no world size ``2..max_world`` divides.

    Args:
        depth: the fewest and the most layers.
        max_world: the largest world size the widths must not divide by.
        tied: ``None`` draws it, ``True``/``False`` forces it (tied models have at least
            three layers).
        frozen: whether to draw frozen layers (at least one layer stays trainable).

    Returns:
        A hypothesis strategy of ``ModelSpec``s.

    Raises:
        ImportError: if hypothesis (a test extra) is not installed.
    """
    from hypothesis import strategies as st

    widths = st.sampled_from(_odd_widths(max_world))

    @st.composite
    def draw(draw: Any) -> ModelSpec:
        is_tied = draw(st.booleans()) if tied is None else tied
        lo, hi = depth
        if is_tied:
            a, b = draw(widths), draw(widths)
            middle = draw(st.lists(widths, min_size=max(0, lo - 3), max_size=max(0, hi - 3)))
            ws = (a, b, *middle, a, b)
        else:
            ws = tuple(draw(st.lists(widths, min_size=lo + 1, max_size=hi + 1)))
        layers = len(ws) - 1
        cold: tuple[int, ...] = ()
        if frozen and layers > 1:
            cold = tuple(sorted(draw(st.sets(st.integers(0, layers - 1), max_size=layers - 1))))
            if is_tied and (0 in cold) != (layers - 1 in cold):  # a tied weight is frozen in both or neither
                cold = tuple(i for i in cold if i not in (0, layers - 1))
        return ModelSpec(ws, is_tied, cold, draw(st.integers(0, 2**16)))

    return draw()


def plans() -> SearchStrategy[PlanSpec]:
    """``PlanSpec``s: one unit, a unit per layer (with or without a split root; one to three
    consecutive layers per unit), or by size.

    Returns:
        A hypothesis strategy of ``PlanSpec``s.

    Raises:
        ImportError: if hypothesis (a test extra) is not installed.
    """
    from hypothesis import strategies as st

    return st.one_of(
        st.just(PlanSpec("whole")),
        st.builds(PlanSpec, st.just("layers"), st.just(1), st.booleans(), st.integers(1, 3)),
        st.builds(PlanSpec, st.just("size"), st.integers(1, 60), st.booleans()),
    )


def worlds(max_world: int = 4) -> SearchStrategy[int]:
    """World sizes ``1..max_world``.

    Args:
        max_world: the largest world size (at most the pool's).

    Returns:
        A hypothesis strategy of ints.

    Raises:
        ImportError: if hypothesis (a test extra) is not installed.
    """
    from hypothesis import strategies as st

    return st.integers(1, max_world)


def layouts(max_world: int = 4, *, hybrid: bool = True) -> SearchStrategy[LayoutSpec]:
    """``LayoutSpec``s: any world size ``1..max_world`` sharded plainly and, with ``hybrid``,
    ``max_world`` ranks as every proper factorisation into replicas x shards.

    Args:
        max_world: the largest world size; hybrid layouts use exactly this many ranks, so
            it should be the pool's size.
        hybrid: whether to draw hybrid layouts too (there are none when ``max_world`` is 1
            or prime).

    Returns:
        A hypothesis strategy of ``LayoutSpec``s.

    Raises:
        ImportError: if hypothesis (a test extra) is not installed.
    """
    from hypothesis import strategies as st

    plain = st.builds(LayoutSpec, worlds(max_world))
    factors = [r for r in range(2, max_world) if max_world % r == 0]
    if not hybrid or not factors:
        return plain
    return st.one_of(plain, st.builds(LayoutSpec, st.just(max_world), st.sampled_from(factors)))
