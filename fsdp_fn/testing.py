"""A toolkit for property tests of sharded training code: real ranks, strategies, parity.

``RankPool`` runs a function on ``W`` real gloo ranks kept alive across calls (spawning
ranks and joining a process group costs seconds; a pool pays that once per session).
``pool.run(fn, *args, world=W)`` calls ``fn(group, *args)`` on ranks ``0..W-1`` with
``group`` a real ``ProcessGroup`` of exactly those ranks (one is made for every size at
start-up), and returns the ranks' results in rank order. A rank that raises, or ranks
that run past the timeout, raise ``RankError`` here with every rank's traceback; a pool
whose ranks may be stuck in a collective is killed and respawned on next use. Inside the
ranks hypothesis runs with a deterministic profile, so every rank draws the same examples.

Hypothesis strategies draw what a sharded run depends on: ``models`` (depths, widths
that divide by no world size, tied and frozen parameters), ``plans`` (unit policies),
``worlds`` and ``layouts`` (world sizes, hybrid sharding). ``assert_matches_unsharded``
trains or differentiates a model sharded and unsharded and raises ``Divergence`` naming
the first step, unit and parameter that differ.

>>> pool = RankPool(2)                                # doctest: +SKIP
>>> pool.run(my_test_fn, 3, world=2)                  # doctest: +SKIP
[result_on_rank0, result_on_rank1]
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import itertools
import multiprocessing as mp
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree
from torch import nn

from fsdp_fn._plan import Plan, Policy, layer_policy, make_plan, size_policy, unit_label

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

_groups: dict[int, Any] = {}


def pool_group(world: int) -> Any:
    """Inside a pool rank: the pool's group of ranks ``0..world-1`` (``None`` where this rank is not in it)."""
    group = _groups[world]
    return group if isinstance(group, dist.ProcessGroup) else None


class RankError(RuntimeError):
    """One or more ranks failed (or timed out); the message carries each rank's traceback.

    ``results`` maps each rank that answered to ``("ok", value)`` or ``("err", traceback)``.
    """

    def __init__(self, message: str, results: dict[int, tuple[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.results = results or {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world: int, port: int, conn: Connection, threads: int, timeout_s: float, strict: bool, backend: str
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    groups: dict[int, Any] = {w: dist.new_group(list(range(w))) for w in range(1, world)}
    groups[world] = dist.group.WORLD
    _groups.update(groups)
    try:
        from hypothesis import settings

        settings.register_profile("fsdp_fn", derandomize=True, database=None, deadline=None, print_blob=False)
        settings.load_profile("fsdp_fn")
    except ImportError:  # pragma: no cover - hypothesis is a test extra
        pass
    with warnings.catch_warnings():
        # torch loads its forward-mode decompositions on the first jvp through torch.jit.script,
        # which warns (deprecated): load them now, so a test's first jvp does not fail on it.
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module("torch._decomp.decompositions_for_jvp")
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs, w = msg
        try:
            with warnings.catch_warnings():
                if strict:
                    warnings.simplefilter("error")
                result = fn(groups[w], *args, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # report, and keep serving
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankPool:
    """``world`` gloo ranks in spawned processes, each with ``threads`` torch threads.

    Inside a rank, warnings are errors (as in the test suite) unless ``warnings_as_errors=False``.
    """

    def __init__(
        self,
        world: int,
        *,
        threads: int = 1,
        timeout: float = 300.0,
        collective_timeout: float = 60.0,
        warnings_as_errors: bool = True,
        backend: str = "gloo",
    ) -> None:
        if world < 1:
            raise ValueError(f"a pool needs at least one rank, got world={world}")
        self.world, self.threads, self.timeout = world, threads, timeout
        self.collective_timeout = collective_timeout
        self.warnings_as_errors = warnings_as_errors
        self.backend = backend
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.last_pids: list[int] = []  # the processes of the pool closed last (to check none is left)
        self.last_exitcodes: list[int | None] = []  # and how they ended (negative: killed by that signal)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world):
            here, there = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(
                    rank,
                    self.world,
                    port,
                    there,
                    self.threads,
                    self.collective_timeout,
                    self.warnings_as_errors,
                    self.backend,
                ),
                daemon=True,
                name=f"fsdp_fn-rank{rank}",
            )
            p.start()
            self._procs.append(p)
            self._conns.append(here)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(120):
                self.close()
                raise RankError(f"rank {rank} did not start within 120 s")
            conn.recv()

    def run(
        self, fn: Callable[..., Any], *args: Any, world: int | None = None, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``fn(group, *args, **kwargs)`` on ranks ``0..world-1``; their results in rank order."""
        w = self.world if world is None else world
        if not 1 <= w <= self.world:
            raise ValueError(f"world={w} does not fit a pool of {self.world} ranks")
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        conns = self._conns[:w]
        for conn in conns:
            conn.send((fn, args, kwargs, w))
        deadline = time.monotonic() + (timeout or self.timeout)
        results: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(conns))
        while pending:
            left = deadline - time.monotonic()
            # Once a rank has failed, the others get a short grace to report (or they hang in a collective).
            if any(kind == "err" for kind, _ in results.values()):
                left = min(left, 10.0)
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                break
            for done in ready:
                rank = next(r for r, c in pending.items() if c is done)
                try:
                    results[rank] = pending[rank].recv()
                except EOFError:
                    results[rank] = ("err", f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                del pending[rank]
        failed = [r for r, (kind, _) in results.items() if kind == "err"]
        if pending or failed:
            report = []
            for rank in range(w):
                kind, value = results.get(rank, ("err", "no answer before the timeout (hung or killed)"))
                if kind == "err":
                    report.append(f"--- rank {rank} ---\n{value}")
            if pending or len(failed) != w:
                # Ranks may be stuck in, or out of step with, a collective: start afresh next time.
                self.close()
            raise RankError(f"{fn.__qualname__} failed on {len(report)} of {w} ranks:\n" + "\n".join(report), results)
        return [results[r][1] for r in range(w)]

    def close(self) -> None:
        if self._procs:
            self.last_pids = [p.pid for p in self._procs]
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self._procs:
            self.last_exitcodes = [p.exitcode for p in self._procs]
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- models, plans and layouts to draw ------------------------------------------------------


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
    """A drawn model, small enough to send to ranks: ``build()`` makes the same module on every rank."""

    widths: tuple[int, ...]
    tied: bool = False
    frozen: tuple[int, ...] = ()
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def build(self) -> StackMLP:
        torch.manual_seed(self.seed)
        return StackMLP(self.widths, tied=self.tied, frozen=self.frozen).to(self.dtype)

    def batch(self, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and regression targets, the same on every rank for the same ``seed``."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(size, self.widths[0], generator=g, dtype=self.dtype)
        return x, torch.randn(size, self.widths[-1], generator=g, dtype=self.dtype)


@dataclass(frozen=True)
class PlanSpec:
    """A drawn unit policy: ``"whole"`` (one root unit), ``"layers"`` (a unit per ``nn.Linear``)
    or ``"size"`` (``size_policy(min_num_params)``); ``split_root`` as in ``make_plan``."""

    policy: str = "layers"
    min_num_params: int = 1
    split_root: bool = False

    def make(self, module: nn.Module) -> Plan:
        policies: dict[str, Policy | None] = {
            "whole": None,
            "layers": layer_policy([nn.Linear]),
            "size": size_policy(self.min_num_params),
        }
        return make_plan(module, policies[self.policy], split_root=self.split_root)


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

    ``tied``: ``None`` draws it, ``True``/``False`` forces it (tied models have at least
    three layers). ``frozen``: whether to draw frozen layers (at least one layer stays
    trainable).
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
    """``PlanSpec``s: one unit, a unit per layer (with or without a split root), or by size."""
    from hypothesis import strategies as st

    return st.one_of(
        st.just(PlanSpec("whole")),
        st.builds(PlanSpec, st.just("layers"), st.just(1), st.booleans()),
        st.builds(PlanSpec, st.just("size"), st.integers(1, 60), st.booleans()),
    )


def worlds(max_world: int = 4) -> SearchStrategy[int]:
    """World sizes ``1..max_world``."""
    from hypothesis import strategies as st

    return st.integers(1, max_world)


def layouts(max_world: int = 4, *, hybrid: bool = True) -> SearchStrategy[LayoutSpec]:
    """``LayoutSpec``s: any world size ``1..max_world`` sharded plainly and, with ``hybrid``,
    ``max_world`` ranks as every proper factorisation into replicas x shards."""
    from hypothesis import strategies as st

    plain = st.builds(LayoutSpec, worlds(max_world))
    factors = [r for r in range(2, max_world) if max_world % r == 0]
    if not hybrid or not factors:
        return plain
    return st.one_of(plain, st.builds(LayoutSpec, st.just(max_world), st.sampled_from(factors)))


# --- parity with the unsharded model --------------------------------------------------------


class Divergence(AssertionError):
    """The sharded run and the unsharded reference differ; ``where`` names the first place.

    ``where`` holds ``step`` (0-based), ``what`` (``"loss"``, ``"gradient"`` or
    ``"parameter"``), ``unit`` and ``parameter`` (``None`` for the loss) and ``error`` (the
    largest absolute difference).
    """

    def __init__(self, message: str, where: dict[str, Any]) -> None:
        super().__init__(message)
        self.where = where


def split_batch(batch: Any, rank: int, world: int) -> Any:
    """This rank's equal part (along dim 0) of every tensor in ``batch``."""

    def part(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % world:
            raise ValueError(f"a global batch of {t.shape[0]} does not split evenly over {world} ranks")
        return t.chunk(world)[rank]

    return torch_pytree.tree_map(part, batch)


def assert_matches_unsharded(
    module: nn.Module,
    loss_fn: Callable[[Callable[..., Any], Any], torch.Tensor],
    batches: Sequence[Any],
    *,
    group: Any = None,
    policy: Policy | None = None,
    plan: Plan | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    split: Callable[[Any, int, int], Any] = split_batch,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **step_options: Any,
) -> dict[str, float]:
    """Run ``module`` sharded over ``group`` and unsharded here; raise ``Divergence`` at the first difference.

    Call it on every rank. Each step takes one global batch from ``batches``; the sharded
    run gives each rank ``split(batch, rank, world)`` and averages over ranks, the
    reference runs the whole batch in this process. With ``optimizer`` (a factory:
    tensors -> ``torch.optim.Optimizer``) it trains: ``train_step`` with
    ``from_torch(optimizer(shards))`` against ``optimizer(params)`` on a copy of the
    module, comparing the loss, then every parameter after each step. Without it, it
    differentiates with ``value_and_grad`` (the train step's gradient function): the loss
    and every gradient at the initial parameters, per batch. ``step_options`` go to
    ``train_step``. Compares in plan order, with ``|sharded - reference| <= atol + rtol *
    |reference|`` (the train step reports its loss in float32, so training compares the
    loss to at least float32's epsilon); returns the largest absolute difference seen for
    the loss, the gradients and the parameters. Memory: the whole model twice on every
    rank (the reference and the unsharded result); communication: the run's own, plus one
    all-gather per unit per comparison.
    """
    from fsdp_fn._collectives import all_gather, all_reduce_
    from fsdp_fn._functional import functionalize
    from fsdp_fn._grad import value_and_grad
    from fsdp_fn._optim import from_torch
    from fsdp_fn._shard import shard, unshard
    from fsdp_fn._step import train_step

    if step_options and optimizer is None:
        raise ValueError(f"train_step options {sorted(step_options)} need an optimizer: without one nothing trains")
    plan = plan if plan is not None else make_plan(module, policy)
    fn = functionalize(module)
    params = shard(fn.params, plan, group)
    pg = params.group
    # Data parallel over every rank: with replicas (hybrid sharding), over the whole mesh.
    world = params.layout.world * params.layout.replicas
    rank = pg.rank() if params.layout.replicate is None else dist.get_rank()
    reference = copy.deepcopy(module)
    trainable = {k: p for k, p in reference.named_parameters() if p.requires_grad}
    worst = {"loss": 0.0, "gradient": 0.0, "parameter": 0.0}

    def mean_over_ranks(x: torch.Tensor) -> float:
        every = all_gather(x.detach().double().reshape(1), pg)
        if params.layout.replicate is not None:
            all_reduce_(every, params.layout.replicate)
            every = every / params.layout.replicas
        return float(every.mean())

    def compare(
        step: int, what: str, name: str | None, got: torch.Tensor, want: torch.Tensor, rel: float = rtol
    ) -> None:
        got, want = got.detach().double(), want.detach().double()
        diff = (got - want).abs()
        error = float(diff.max()) if diff.numel() else 0.0
        worst[what] = max(worst[what], error)
        if not bool((diff > atol + rel * want.abs()).any()):
            return
        unit = plan.unit_of(name).name if name is not None else None
        at = f"the {what} of unit {unit_label(unit)}, parameter {name!r}," if unit is not None else "the loss"
        index = tuple(int(i) for i in torch.nonzero(diff == error)[0])
        raise Divergence(
            f"step {step}: {at} differs from the unsharded model's by {error:.3g} (largest at index {index}: "
            f"sharded {float(got[index]):.8g}, unsharded {float(want[index]):.8g}; atol={atol}, rtol={rel})",
            {"step": step, "what": what, "unit": unit, "parameter": name, "error": error},
        )

    if optimizer is None:
        for step, batch in enumerate(batches):
            loss, grads = value_and_grad(fn, loss_fn)(params, fn.buffers, split(batch, rank, world))
            reference.zero_grad()
            want = loss_fn(reference, batch)
            want.backward()
            compare(step, "loss", None, torch.tensor(mean_over_ranks(loss), dtype=torch.float64), want)
            full = unshard(grads, frozen=False)
            for spec in plan.params:
                if spec.name in trainable:
                    ref_grad = trainable[spec.name].grad
                    compare(
                        step,
                        "gradient",
                        spec.name,
                        full[spec.name],
                        torch.zeros(spec.shape) if ref_grad is None else ref_grad,
                    )
        return worst

    state_opt = optimizer(list(trainable.values()))
    step_fn = train_step(fn, loss_fn, from_torch(optimizer(list(params.values()))), **step_options)
    state = step_fn.init(params)
    for step, batch in enumerate(batches):
        state, metrics = step_fn(state, split(batch, rank, world))
        state_opt.zero_grad()
        want = loss_fn(reference, batch)
        want.backward()
        state_opt.step()
        # The step reports its loss in float32.
        compare(step, "loss", None, metrics["loss"], want, max(rtol, torch.finfo(torch.float32).eps))
        full = unshard(state.params)
        for spec in plan.params:
            compare(step, "parameter", spec.name, full[spec.name], dict(reference.named_parameters())[spec.name])
    return worst
