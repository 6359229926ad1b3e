"""``RankPool``: ``W`` real gloo ranks in spawned processes, kept alive across calls, and their groups.

``pool.run(fn, *args, world=W)`` calls ``fn(group, *args)`` on ranks ``0..W-1`` with ``group`` a
real ``ProcessGroup`` of exactly those ranks (one is made for every size at start-up) and
returns the ranks' results in rank order; a rank that raises, or ranks that run past the
timeout, raise ``RankError`` with every rank's traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

_groups: dict[int, Any] = {}


def pool_group(world: int) -> Any:
    """Inside a pool rank: the pool's group of ranks ``0..world-1`` (``None`` where this rank is not in it).

    The pool made one group for every size at start-up: no communication, nothing made.

    Args:
        world: how many ranks, from rank 0, the group holds (at most the pool's size).

    Returns:
        The ``ProcessGroup``, or ``None`` on a rank that is not in it.

    Raises:
        KeyError: if the pool made no group of that size (``world`` larger than the pool,
            or a call outside a pool rank).
    """
    group = _groups[world]
    return group if isinstance(group, dist.ProcessGroup) else None


class RankError(RuntimeError):
    """One or more ranks failed (or timed out); the message carries each rank's traceback.

    Args:
        message: which function failed on how many ranks, and each failed rank's traceback.
        results: what each rank that answered sent back.

    Attributes:
        results: maps each rank that answered to ``("ok", value)`` or ``("err", traceback)``.
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
    The ranks start at the first ``run`` (seconds: spawning processes and joining a process
    group), with one group for every size ``1..world``, and live until ``close()`` (or the
    end of a ``with`` block); a pool whose ranks may be stuck in a collective is closed and
    started afresh at the next ``run``. Inside the ranks hypothesis runs with a deterministic
    profile, so every rank draws the same examples.

    Args:
        world: how many ranks.
        threads: torch threads per rank (``torch.set_num_threads``).
        timeout: seconds a ``run`` waits for every rank's answer, unless it says otherwise.
        collective_timeout: the process group's timeout, in seconds, for one collective.
        warnings_as_errors: whether a warning inside a rank is an error.
        backend: the ``torch.distributed`` backend (``"gloo"``; ``"nccl"`` puts rank ``r``
            on GPU ``r`` modulo the GPUs there are).

    Attributes:
        last_pids: the process ids of the ranks the last ``close()`` ended.
        last_exitcodes: how they ended (negative: killed by that signal).

    Raises:
        ValueError: if ``world`` is less than 1.
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
        """``fn(group, *args, **kwargs)`` on ranks ``0..world-1``; their results in rank order.

        ``group`` is the pool's ``ProcessGroup`` of exactly those ranks. Starts the ranks
        first if they are not running. Once a rank has failed, the others get 10 seconds
        more to answer; if some ranks did not fail, or did not answer, the pool is closed
        (its ranks may be stuck in a collective) and the next ``run`` starts new ones.

        Args:
            fn: the function each rank calls; it, its arguments and its result travel
                between processes, so they must pickle (a module-level function).
            *args: passed on to ``fn``.
            world: how many ranks run it; ``None``: every rank of the pool.
            timeout: seconds to wait for every answer; ``None``: the pool's ``timeout``.
            **kwargs: passed on to ``fn``.

        Returns:
            The ranks' results, in rank order.

        Raises:
            ValueError: if ``world`` is not between 1 and the pool's size.
            RankError: if a rank raised, died or did not answer before the timeout, with
                every failed rank's traceback; also if a rank does not start within 120 s.
        """
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
        """Stop the ranks: each is asked to leave, and killed if it has not within 5 seconds.

        Records their process ids and exit codes (``last_pids``, ``last_exitcodes``); the next
        ``run`` starts new ranks. Does nothing when none is running.
        """
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
