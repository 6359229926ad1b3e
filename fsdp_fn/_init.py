"""Materialise a model built on the meta device straight into shards, one unit at a time."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fsdp_fn._agree import agree
from fsdp_fn._functional import entries_set
from fsdp_fn._group import Group, Role, resolve_axes
from fsdp_fn._guard import guarded
from fsdp_fn._plan import Plan, Unit, unit_label
from fsdp_fn._shard import Layout, Sharded, frozen_slices, local_slice

Init = Callable[[nn.Module], None]


def _unit_seed(seed: int, unit: str) -> int:
    return int(hashlib.sha256(f"{seed}:{unit}".encode()).hexdigest()[:15], 16)


def _swapped(
    slots: list[tuple[nn.Module, str, str]], tensors: dict[str, torch.Tensor], kind: str
) -> contextlib.AbstractContextManager[None]:
    """Put ``tensors`` (by canonical name) into the module's slots; put the originals back after."""
    table = "_parameters" if kind == "param" else "_buffers"
    return entries_set((getattr(owner, table), attr, tensors[name]) for owner, attr, name in slots)


def _check_initialisable(module: nn.Module) -> None:
    covered: set[str] = set()
    for path, m in module.named_modules():
        if hasattr(m, "reset_parameters"):
            covered.add(path)
    for path, m in module.named_modules():
        if not m._parameters:
            continue
        parts = path.split(".") if path else []
        ancestors = {".".join(parts[:k]) for k in range(len(parts) + 1)}
        if not ancestors & covered:
            raise ValueError(
                f"module {unit_label(path)} ({type(m).__name__}) is on the meta device and owns parameters, "
                "but neither it nor a module above it has reset_parameters(); pass init=fn (called like "
                "module.apply(fn)) to initialise it"
            )


def init_shards(
    module: nn.Module,
    plan: Plan,
    group: Group = None,
    *,
    init: Init | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    timeout: float = 300.0,
) -> tuple[Sharded, dict[str, torch.Tensor]]:
    """Initialise a model built under ``torch.device("meta")`` directly into this rank's shards.

    Unit by unit: the unit's parameters are materialised on ``device``, initialised by
    ``init`` (applied like ``module.apply(init)``) or else by every module's own
    ``reset_parameters()`` (children first, as at construction), this rank's slice is
    kept and the full unit dropped. Memory: the shards plus one full unit, never the
    model. Each unit's values come from a generator seeded by ``(seed, unit name)``, so
    the full model is the same whatever the world size. Buffers are materialised whole on
    every rank (they are replicated) and returned. The module itself stays on meta.
    Communication: one small all-gather of the plan's fingerprint.

    Args:
        module: the model, built under ``torch.device("meta")``; left on meta.
        plan: the plan to shard by (``make_plan(module, ...)``), the same on every rank.
        group: the ranks that shard together: a ``ProcessGroup``, a 1-D ``DeviceMesh``, a
            mesh of named axes for hybrid sharding (as ``shard`` takes), or ``None`` (the default group).
        init: ``init(module)``, called on every module of a unit, children first, as
            ``module.apply(init)`` calls it; ``None``: each module's own
            ``reset_parameters()``.
        seed: the seed that, with a unit's name, seeds the generator its values come from.
        device: where the shards and buffers are made.
        timeout: seconds to wait on the other ranks while they agree on the plan.

    Returns:
        ``(params, buffers)``: this rank's shards, as ``shard`` would have made them from
        the initialised model, and the module's buffers by name, whole.

    Raises:
        TypeError: if ``init`` is not callable, or ``group`` is not a group, mesh or ``None``.
        ValueError: if ``init`` is ``None`` and a module owning parameters has no
            ``reset_parameters()`` (nor has a module above it), or ``group`` is a mesh of
            more than two dimensions or a group this rank is not a member of.
        RuntimeError: if ``torch.distributed`` is not initialised.
        DivergenceError: if the ranks' plans differ.
        RankFailure: if another rank failed or went silent for ``timeout``.
    """
    axes = resolve_axes(group)
    pg = next(a.group for a in axes if a.role is Role.SHARD)
    if init is not None and not callable(init):
        raise TypeError(f"init must be callable as init(module), got {type(init).__name__}")
    if init is None:
        _check_initialisable(module)
    for g in (a.group for a in axes):
        with guarded(g, "init_shards", timeout):
            agree(
                g,
                "plan",
                {"plan": plan.fingerprint()},
                hint="build the plan from the same model and policy on every rank",
            )
    world, rank = pg.size(), pg.rank()

    param_slots: dict[str, list[tuple[nn.Module, str, str]]] = {}
    for unit in plan.units:
        for spec in unit.all_params:
            for name in (spec.name, *spec.aliases):
                owner, _, attr = name.rpartition(".")
                param_slots.setdefault(unit.name, []).append((module.get_submodule(owner), attr, spec.name))
    buffer_slots: list[tuple[nn.Module, str, str]] = []
    buffers: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}  # a buffer shared under several names is materialised once
    for name, b in module.named_buffers(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        canonical = first_name.setdefault(id(b), name)
        buffer_slots.append((module.get_submodule(owner), attr, canonical))
        if canonical == name:
            buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)

    def initialise() -> None:
        for m in _post_order(module):
            if init is not None:
                init(m)
            elif callable(reset := getattr(m, "reset_parameters", None)):
                reset()

    shards: dict[str, torch.Tensor] = {}
    frozen: dict[str, tuple[torch.Tensor, ...]] = {}
    with _swapped(buffer_slots, buffers, "buffer"), torch.random.fork_rng(devices=[]):
        for unit in plan.units:
            full = _materialise(unit, device)
            torch.manual_seed(_unit_seed(seed, unit.name))
            with torch.no_grad(), _swapped(param_slots[unit.name], full, "param"):
                initialise()
            shards[unit.name] = local_slice(unit, full, world, rank)
            if unit.frozen:
                frozen[unit.name] = frozen_slices(unit, full, world, rank)
            del full
    return Sharded(shards, Layout(plan, axes, frozen)), buffers


def _materialise(unit: Unit, device: torch.device | str) -> dict[str, torch.Tensor]:
    return {
        spec.name: nn.Parameter(
            torch.empty(spec.shape, dtype=spec.dtype, device=device), requires_grad=spec.requires_grad
        )
        for spec in unit.all_params  # frozen ones too: the unit's modules initialise them alike
    }


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module
