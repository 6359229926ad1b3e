"""What running a module over shards needs that is the same at every call, worked out once.

``Wiring.of(fn, params, schedule, ...)`` is made at the first call like it and kept with the
module: each unit's modules and where a gather puts its parameters, the stand-ins of the
units not gathered, where each tensor of a call goes (what ``functional_call`` would work
out at every call), compiled units, the units to rematerialise, the prefetch limit, the
lookups that may fetch their rows. A step's call (``_runtime.py``) reads it and does none of
this again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_fn._collectives import comm_of
from fsdp_fn._functional import Functional, index_of
from fsdp_fn._lookup import fetchable
from fsdp_fn._plan import ROOT, ParamSpec, Plan, Unit, unit_label
from fsdp_fn._policy import Schedule
from fsdp_fn._prefetch import gathered_bytes, inflight_limit
from fsdp_fn._remat import Remat
from fsdp_fn._shard import Sharded
from fsdp_fn._standin import StandIn


def _not_gathered(spec: ParamSpec, unit: str, device: torch.device) -> StandIn:
    """Stands in for a unit's parameter outside that unit's forward: what it is (shape, dtype, the
    device the unit runs on, requires_grad) can be read, as ``x.to(w.device)`` does; any use raises."""
    return StandIn(
        spec.shape,
        spec.dtype,
        device,
        f"parameter {spec.name!r} of unit {unit_label(unit)} was used outside that unit's forward ({{op}}); "
        "a unit's parameters exist only while its module runs: call the module (not .forward directly) "
        "or put this use in the same unit",
        requires_grad=spec.requires_grad,
    )


class Wiring:
    """What running a module over shards needs that is the same at every call: each unit's
    modules and where a gather puts its parameters, the units to rematerialise, the prefetch
    limit, the lookups that may fetch their rows. Made once per module, plan, schedule and group
    (``Wiring.of``), then shared by every call: a step's Runtime does none of this again."""

    def __init__(
        self,
        fn: Functional,
        params: Sharded,
        schedule: Schedule,
        remat: Remat | None,
        composable: bool,
        deferred: bool,
        compile: Mapping[str, Any] | None = None,
    ) -> None:
        _check_plan_fits(params.plan, fn)
        module, plan = fn.module, params.plan
        self.keep = (plan, schedule, remat)  # (the cache's key holds their ids)
        self.plan = plan
        self.sparse_grads = _sparse_grad_params(module, plan) if composable else frozenset()
        self.modules: dict[str, nn.Module] = {
            u.name: module.get_submodule(u.name) for u in plan.units if not u.hooks and not u.members
        }
        # Each unit's modules, one entry per module object (a module shared under several
        # paths is hooked once), and where a gather puts its parameters in it.
        self.targets: dict[str, list[nn.Module]] = {}
        self.slots: dict[tuple[str, int], list[tuple[nn.Module, str, str]]] = {}
        for unit in plan.units:
            seen: dict[int, nn.Module] = {}
            for path in unit.modules:
                target = module.get_submodule(path)
                seen.setdefault(id(target), target)
                slots = self.slots.setdefault((unit.name, id(target)), [])
                for spec in unit.all_params:
                    for full_name in (spec.name, *spec.aliases):
                        owner, _, attr = full_name.rpartition(".")
                        if _holds(unit, path, owner):
                            slot = (module.get_submodule(owner), attr, spec.name)
                            if not any(s[0] is slot[0] and s[1] == attr for s in slots):
                                slots.append(slot)
            self.targets[unit.name] = list(seen.values())
        # Units whose module is compiled (``module.compile()``, or ``compile=`` here): their call goes
        # through a wrapper of ours around the compiled code, so nothing of the gathering is traced.
        self.compiled: dict[int, Callable[..., Any]] = {}
        for unit in plan.units:
            for target in self.targets[unit.name] if unit.name != ROOT else ():
                own = target.__dict__.get("_compiled_call_impl")
                if own is not None:
                    self.compiled[id(target)] = own
                elif compile is not None:
                    self.compiled[id(target)] = torch.compile(target._call_impl, **compile)
        # Units that can be rematerialised run through a forward of ours for the call: the
        # ones ``remat`` selects, and the ones a torch.utils.checkpoint region asks for
        # (compiled ones are rematerialised around their compiled call instead).
        self.own_unit: dict[int, Unit] = {
            id(target): u
            for u in plan.units
            if u.own_module or u.members
            for target in self.targets[u.name]
            if id(target) not in self.compiled
        }
        self.own_modules = {id(t): t for ts in self.targets.values() for t in ts if id(t) in self.own_unit}
        self.remat_units = remat.selects(plan, module) if remat is not None else frozenset()
        for unit in plan.units:  # (in plan order: the first refused is named, on every rank the same)
            if unit.name in self.remat_units:
                compiled = any(id(t) in self.compiled for t in self.targets[unit.name])
                check_rematerialisable(fn, plan, unit, "train_step(remat=...)", compiled)
        self._within: dict[tuple[int, ...], tuple[Unit, ...]] = {}
        # Each non-root unit's gathered bytes; prefetching may hold max_inflight times the largest.
        self.unit_bytes = gathered_bytes(plan, params.group.size(), schedule)
        self.inflight_limit = inflight_limit(self.unit_bytes, schedule)
        # Outside its forward each non-root unit's parameter is a stand-in that raises if read.
        offload = schedule.cpu_offload
        self.standins = {
            p.name: _not_gathered(p, u.name, offload.compute_device() if offload else params[u.name].device)
            for u in plan.units
            if u.name != ROOT
            for p in u.all_params
        }
        # Where each tensor of a call goes, what ``functional_call`` would work out at every call:
        # (owner, attribute, the tensor's name, a parameter?) for every name of every parameter the
        # plan knows (tied aliases included) and of every buffer (tied ones by their first name).
        index = index_of(module)
        canonical = {name: spec.name for spec in plan.params for name in (spec.name, *spec.aliases)}
        self.swaps: list[tuple[nn.Module, str, str, bool]] = [
            (holder, attr, canonical[name], True) for name, holder, attr in index.param_slots if name in canonical
        ]
        first: dict[int, str] = {}
        for name, holder, attr in index.buffer_slots:
            buffer = holder._buffers[attr]
            if buffer is not None:
                self.swaps.append((holder, attr, first.setdefault(id(buffer), name), False))
        self.lookups = frozenset(u.name for u in plan.units if u.lookup)
        # Lookups that may fetch their rows instead of gathering their table (``_lookup.py``).
        self.row_lookups = fetchable(
            plan,
            params,
            schedule,
            self.modules,
            rematerialised=self.remat_units,
            compiled=self.compiled,
            composable=composable,
            deferred=deferred,
        )

    def units_within(self, modules: Sequence[nn.Module]) -> tuple[Unit, ...]:
        """The non-root units gathered by a module inside ``modules`` (or one of them), in plan order:
        the units a region over ``modules`` may call. Worked out once per set of modules."""
        key = tuple(id(m) for m in modules)
        found = self._within.get(key)
        if found is None:
            inside = {id(sub) for m in modules for sub in m.modules()}
            found = self._within[key] = tuple(
                u for u in self.plan.units if u.name != ROOT and any(id(t) in inside for t in self.targets[u.name])
            )
        return found

    @staticmethod
    def of(
        fn: Functional,
        params: Sharded,
        schedule: Schedule,
        remat: Remat | None,
        composable: bool,
        deferred: bool,
        compile: Mapping[str, Any] | None = None,
    ) -> Wiring:
        """The wiring for this call, made at the first call like it and kept with ``fn``."""
        group = params.group
        shard = next(iter(params.shards.values()), None)
        key = (
            id(params.plan),
            id(schedule),
            id(remat),
            composable,
            deferred,
            group.group_name,
            comm_of(group).pairwise,  # (a lookup fetches rows over a pairwise comm only)
            params.layout.replicas,
            shard.device.type if shard is not None else "",
            None if compile is None else tuple(sorted(compile.items())),
        )
        known = _wirings.setdefault(fn, {})
        wiring = known.get(key)
        if wiring is None:
            if len(known) >= 8:  # a caller that builds a new schedule at every call: keep the newest only
                del known[next(iter(known))]
            wiring = known[key] = Wiring(fn, params, schedule, remat, composable, deferred, compile)
        return wiring


_wirings: weakref.WeakKeyDictionary[Functional, dict[tuple[Any, ...], Wiring]] = weakref.WeakKeyDictionary()


def _holds(unit: Unit, path: str, owner: str) -> bool:
    """Whether module ``path`` of ``unit`` holds a parameter whose owner is module ``owner``:
    a module's own unit holds all of its, a shared one's user its own, a group's member what lies in it."""
    if unit.members:
        return owner == path or owner.startswith(path + ".")
    return not unit.hooks or owner == path


def check_rematerialisable(fn: Functional, plan: Plan, unit: Unit, asked_by: str, compiled: bool = False) -> None:
    """A rematerialised unit is recomputed in backward, after this call's hooks are gone: every
    parameter it reads must be its own or one of a unit gathered by a module inside it (a unit
    of its own, a module it shares with another block), which the recomputation gathers again
    (not under a compiled unit, whose recomputation is its compiled code); another unit's would
    not be gathered then. A group's modules are checked each."""
    own = {spec.name for spec in unit.all_params} | {a for spec in unit.all_params for a in spec.aliases}
    for path in unit.modules:
        _check_reads_only(fn.module.get_submodule(path), f"{path}.", own, plan, unit, asked_by, compiled)


def _check_reads_only(
    module: nn.Module, prefix: str, own: set[str], plan: Plan, unit: Unit, asked_by: str, compiled: bool
) -> None:
    for name, _ in module.named_parameters(remove_duplicate=False):
        full = prefix + name
        if full in own:
            continue
        other, owner = plan.unit_of(full), full.rpartition(".")[0]
        if not compiled and any(m.startswith(prefix) and f"{owner}.".startswith(f"{m}.") for m in other.modules):
            continue  # gathered by a module inside it, whose hooks the recomputation installs again
        why = (
            "and it is compiled: its recomputation would not gather that unit"
            if compiled
            else "which no module inside it gathers (a parameter shared with another block), so its recomputation "
            "in backward would not"
        )
        raise ValueError(
            f"{asked_by}: unit {unit_label(unit.name)} cannot be rematerialised: it reads parameter "
            f"{full!r} of unit {unit_label(other.name)}, {why}; "
            "rematerialise the units inside it instead (or put that parameter in this unit)"
        )


def _sparse_grad_params(module: nn.Module, plan: Plan) -> frozenset[str]:
    """The parameters whose gradient is sparse: the weights of ``nn.Embedding(sparse=True)`` and bags."""
    names = {
        f"{path}.weight".lstrip(".")
        for path, m in module.named_modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
    }
    return frozenset(spec.name for spec in plan.params if names & {spec.name, *spec.aliases})


def _check_plan_fits(plan: Plan, fn: Functional) -> None:
    """The shards' plan must describe this module: same parameter names and shapes."""
    tensor = plan.tensor
    for spec in plan.params:
        have = fn.params.get(spec.name)
        shape = None if have is None else tuple(have.shape)
        if shape is not None and tensor is not None:  # (its piece on this rank of the tensor-parallel axis)
            shape = tensor.local_shape(shape, spec.split)
        if shape != spec.shape:
            found = "no such parameter" if shape is None else f"shape {shape}"
            raise ValueError(
                f"these shards were made for another plan: their parameter {spec.name!r} is {spec.shape} "
                f"(unit {unit_label(plan.unit_of(spec.name).name)}) but {type(fn.module).__name__} has {found}"
            )
