"""The phases of a step, by name: profiler ranges in a user's trace, host time per phase for a bench.

``with phase("all_gather"): ...`` marks one phase. While ``torch.profiler`` records, each
phase is a ``record_function`` range named ``fsdp_fn::<phase>`` (FSDP2 names its own
``FSDP::...``), so a user's trace shows where a step's host time goes. While a
``PhaseClock`` is open (``bench/overhead.py``), each phase's host time is summed, exclusive
of the phases nested in it. Otherwise a phase costs one call and a flag test.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

PHASES = (
    "setup",  # the step's own set-up: the guard, the runtime, the module's stand-ins
    "pre_forward",  # a unit's pre-forward hook: its gather waited for, its parameters put in place
    "post_forward",  # a unit's post-forward hook: its buffer freed, the refill hooked
    "all_gather",  # issuing an all-gather (its buffer, its sends and receives)
    "pre_backward",  # a unit's refill before its backward
    "post_backward",  # a unit's gradients written into its flat gradient and handed to the sink
    "reduce_scatter",  # issuing a reduce-scatter, and summing what it received
    "wait",  # waiting for a collective to complete
    "graph_walk",  # finding the uses the loss's backward reaches
    "metrics",  # the metrics all-gather: loss, norm, reached parameters, schedule fingerprint
    "optimizer",  # the optimizer's update
)

F = TypeVar("F", bound=Callable[..., Any])

_clocks: list[PhaseClock] = []
_profiling = torch._C._autograd._profiler_enabled


class PhaseClock:
    """Host time per phase while open: ``seconds`` exclusive (a phase nested in another counts
    once, in the inner one), ``inclusive`` with the phases nested in it, and ``cpu_seconds``
    the thread's CPU time in it, exclusive (what the phase computes, not what it waits for).

    The clock's own bookkeeping is charged to no phase: each phase's count starts after the
    clock is done entering it and stops before the clock starts leaving it (two clock reads
    at each edge, one closing the span before it and one opening the span after)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.cpu_seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        # Per thread (autograd runs a GPU's backward on a thread of its own): [name, counting
        # since, started, its CPU clock counting since] of the phases open now, innermost last.
        self._stacks: dict[int, list[list[Any]]] = collections.defaultdict(list)

    def __enter__(self) -> PhaseClock:
        _clocks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _clocks.remove(self)

    def _enter(self, name: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        stack = self._stacks[threading.get_ident()]
        if stack:
            outer = stack[-1]
            self.seconds[outer[0]] += now - outer[1]
            self.cpu_seconds[outer[0]] += cpu - outer[3]
        self.calls[name] += 1
        entry = [name, 0.0, 0.0, 0.0]
        stack.append(entry)
        entry[1] = entry[2] = time.perf_counter()
        entry[3] = time.thread_time()

    def _exit(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        stack = self._stacks[threading.get_ident()]
        name, counting, started, cpu_counting = stack.pop()
        self.seconds[name] += now - counting
        self.cpu_seconds[name] += cpu - cpu_counting
        self.inclusive[name] += now - started
        if stack:
            outer = stack[-1]
            outer[1] = time.perf_counter()
            outer[3] = time.thread_time()


class _Phase:
    __slots__ = ("name", "range")

    def __init__(self, name: str) -> None:
        self.name = name
        self.range: Any = None

    def __enter__(self) -> None:
        for clock in _clocks:
            clock._enter(self.name)
        if _profiling():
            self.range = torch.autograd.profiler.record_function(f"fsdp_fn::{self.name}")
            self.range.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.range is not None:
            self.range.__exit__(*exc)
        for clock in _clocks:
            clock._exit()


def _timed(name: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn`` as phase ``name`` while a clock is open: the clocks read right before ``fn`` runs
    and right after it returns, so the phase counts as little as it can of their own work."""
    span = None
    if _profiling():
        span = torch.autograd.profiler.record_function(f"fsdp_fn::{name}")
        span.__enter__()
    for clock in _clocks:
        clock._enter(name)
    try:
        return fn(*args, **kwargs)
    finally:
        for clock in reversed(_clocks):
            clock._exit()
        if span is not None:
            span.__exit__(None, None, None)


_NOTHING = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """The context of one phase of a step (see the module's docstring)."""
    if _clocks or _profiling():
        return _Phase(name)
    return _NOTHING


def phased(name: str) -> Callable[[F], F]:
    """Run the decorated function as phase ``name``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _clocks:
                return _timed(name, fn, args, kwargs)
            if _profiling():
                with _Phase(name):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        return cast(F, run)

    return wrap


@contextlib.contextmanager
def phase_clock() -> Iterator[PhaseClock]:
    """Sum the host time of every phase run inside the block (``PhaseClock``).

    While a clock is open, each phase costs two clock reads more; nothing is allocated on
    the device and nothing communicated. Clocks nest: each open clock counts.

    Yields:
        The ``PhaseClock``: ``seconds`` (exclusive), ``inclusive``, ``cpu_seconds`` and
        ``calls``, per phase name (``PHASES``).

    Examples:
        >>> with phase_clock() as clock:
        ...     with phase("optimizer"):
        ...         with phase("wait"):
        ...             pass
        >>> clock.calls["optimizer"], clock.calls["wait"]
        (1, 1)
        >>> clock.inclusive["optimizer"] >= clock.seconds["optimizer"]  # exclusive: the wait is its own
        True
    """
    with PhaseClock() as clock:
        yield clock
