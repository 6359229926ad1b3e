"""No silent hangs: waits that notice failures elsewhere, and a check of the collective schedule.

While a train step, or any other call that communicates (``shard``, ``unshard``,
``init_shards``, ``step.init``, ``value_and_grad``, ...), runs, a ``Guard`` is active on
each rank. Each guarded call first says in the process group's store which call it is;
a call outside a step waits until every rank of the group has said the same (a rank that
calls alone learns which ranks did not join, or what they called instead, before
anything is sent). Every wait on a collective polls instead of blocking, and every so
often looks in the store for what other ranks reported:

* a rank whose call raised (its forward or loss, say, or it gave up waiting) writes the
  error there first, so the others raise it too, naming that rank, instead of waiting
  for it forever;
* a rank that entered another call than this one is named with that call;
* a rank that is gone (killed: its connections break) or silent past ``timeout`` is
  found by asking every rank to sign in: the ranks that do not are named; the store
  itself gone (its host, rank 0, died) names that rank;
* after a call that failed on this rank, the next call on its group first meets every
  rank: what the failed call left in flight either finished by then or never will (its
  peers gave up on it), and then the group is out of step and every rank says so, before
  anything is sent (the common case, no failure, costs nothing more);
* in check mode, before each collective the ranks compare what they are about to issue
  (op, unit, elements, dtype): one small all-gather; a difference raises
  ``DivergenceError`` on every rank, naming the unit and the ranks, before anything hangs.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import os
import queue
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp_fn._errors import DivergenceError, RankFailure
from fsdp_fn._plan import unit_label

__all__ = ["DivergenceError", "Guard", "RankFailure", "current", "guarded", "watch"]

_local = threading.local()
_POLL = 0.005  # seconds a wait on works that can say they are done polls them before a waiter thread takes over
_steps: dict[str, int] = {}  # guarded calls run so far, per group name
# Ranks (global) found dead or silent, and groups whose connections broke: what happened.
# Their pairs are closed (or out of step), so every later collective there would fail or wait.
# The rank that finds one also writes it in the store: a rank that only heard of the failure
# from another (the relayed error) looks there at its next call.
_lost_ranks: dict[int, str] = {}
_lost_groups: dict[str, str] = {}
_heard_of_failure = False  # a RankFailure was raised here: look in the store once, at the next call
_SETTLE = 2.0  # seconds the call after a failure waits for what the failed one left in flight


@dataclass
class _Failure:
    """A guarded call that failed on this rank, and what it left in flight (see ``Guard.settle``)."""

    prefix: str  # its keys in the store
    call: str
    works: list[Watched]  # its exchanges not finished when it failed
    gave_up: str | None  # the collective whose wait it gave up, if any


_failed: dict[str, _Failure] = {}  # group name -> this rank's last guarded call on it, if it failed
_left_in_flight: list[Watched] = []  # works failed calls left in flight (a waiter may still block on them)


def _lost(group: dist.ProcessGroup, missing: Sequence[int], why: str) -> None:
    """Remember (here and in the store) that ``missing`` (group ranks; none: the whole group) are lost."""
    store = _store()
    ranks = [dist.get_global_rank(group, r) for r in missing]
    keys = [f"fsdp_fn/lost/rank/{r}" for r in ranks]
    for r in ranks:
        _lost_ranks.setdefault(r, why)
    if not missing:
        _lost_groups.setdefault(group.group_name, why)
        keys = [f"fsdp_fn/lost/group/{group.group_name}"]
    if store is not None:
        for key in keys:
            with contextlib.suppress(Exception):
                store.set(key, why[:500])


def _look_in_store(group: dist.ProcessGroup) -> None:
    store = _store()
    if store is None:
        return
    keys = {f"fsdp_fn/lost/rank/{r}": r for r in range(dist.get_world_size())}  # any group's
    keys[f"fsdp_fn/lost/group/{group.group_name}"] = -1
    with contextlib.suppress(Exception):
        for key, r in keys.items():
            if store.check([key]):
                why = store.get(key).decode()
                if r < 0:
                    _lost_groups.setdefault(group.group_name, why)
                else:
                    _lost_ranks.setdefault(r, why)


def ensure_usable(group: dist.ProcessGroup) -> None:
    """Raise ``RankFailure`` at once if an earlier call found a rank of ``group`` gone (or the
    group's connections broken), instead of letting a collective fail inside gloo or wait."""
    if group.size() == 1:
        return
    global _heard_of_failure
    if _heard_of_failure:  # (the rank that found the loss wrote it there before telling anyone)
        _heard_of_failure = False
        _look_in_store(group)
    if not (_lost_ranks or _lost_groups):
        return
    why = _lost_groups.get(group.group_name) or _lost_groups.get(_ANY)
    if why is None:
        why = next((_lost_ranks[r] for r in dist.get_process_group_ranks(group) if r in _lost_ranks), None)
    if why is not None:
        raise RankFailure(_unusable(group, why))


_ANY = "*"  # in _lost_groups: every group (the store is gone and torchrun's agent hosted it)


def _unusable(group: dist.ProcessGroup, why: str) -> str:
    return (
        f"process group {group.group_name!r} cannot communicate any more: {why}; restart every rank "
        "(torchrun --max-restarts restarts them) and resume from the last checkpoint (fsdp_fn.checkpoint)"
    )


def _store_host() -> int | None:
    """The global rank whose process hosts the default store: rank 0, where torch's rendezvous
    (``tcp://``, ``env://``) starts it; ``None`` when torchrun's agent hosts it."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


class _StoreUnreachable(Exception):
    """A call to the process group's store failed (its host is gone): ``Guard`` names the host."""


def current() -> Guard | None:
    return getattr(_local, "guard", None)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # no store to talk through
        return None


def describe(op: str, unit: str | None) -> str:
    return f"{op.replace('_', '-')} of unit {unit_label(unit)}" if unit is not None else op.replace("_", "-")


class Guard:
    """What one rank knows while a guarded call runs: its group, the call, its deadline."""

    def __init__(
        self, group: dist.ProcessGroup, step: int, *, timeout: float, check: bool, call: str | None = None
    ) -> None:
        ensure_usable(group)
        self.group, self.step, self.timeout, self.check = group, step, timeout, check
        self.call = call or f"step {step}"
        self.rank, self.world = group.rank(), group.size()
        self.global_rank = dist.get_rank()
        self.store = _store()
        # Keys are unique per guarded call of this group in this process's life, whichever
        # TrainStep or function runs it (all ranks count the same), so no stale report from
        # an earlier failure is ever read as a new one.
        _steps[group.group_name] = serial = _steps.get(group.group_name, 0) + 1
        self.prefix = f"fsdp_fn/{group.group_name}/guarded{serial}"
        self.issued: list[tuple[str, str | None, int, torch.dtype]] = []  # (op, unit, numel, dtype) this call, in order
        self._agreed: set[int] = set()  # ranks seen to have entered the same call
        self.watched: list[Watched] = []  # the exchanges issued in this call (what a failure leaves in flight)
        self.gave_up: str | None = None  # the collective whose wait this call gave up on
        self.after = _failed.pop(group.group_name, None)  # this rank's call before, if it failed
        self._signed = False  # signed in as alive, for a failing rank's roll

    # --- the store: a failure to reach it is the failure of its host ---------------------------------

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except RuntimeError as e:  # (DistNetworkError, DistStoreError)
            raise _StoreUnreachable(e) from e

    def _read(self, key: str) -> str:
        try:
            return str(self.store.get(key).decode())
        except RuntimeError as e:
            raise _StoreUnreachable(e) from e

    def _write(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except RuntimeError as e:
            raise _StoreUnreachable(e) from e

    def _store_gone(self, error: _StoreUnreachable, what: str) -> RankFailure:
        """The process group's store cannot be reached: its host (rank 0's process, or torchrun's
        agent) is gone, and with it the way ranks tell each other what happened. Remembered, so
        every later call on a group with that rank raises at once."""
        cause = error.__cause__ or error
        how = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}"
        host = _store_host()
        if host is None:
            why = f"torchrun's agent, which hosts the process group's store, stopped answering ({how})"
            _lost_groups.setdefault(_ANY, why)
            return RankFailure(f"{why} in {self.call} while rank {self.rank} waited for {what}")
        ranks = dist.get_process_group_ranks(self.group)
        who = f"rank {ranks.index(host)} of group {self.group.group_name!r}" if host in ranks else f"rank {host}"
        _lost_ranks.setdefault(
            host,
            f"rank {host} stopped answering in {self.call} (it hosts the process group's store, which cannot be "
            f"reached: {how}); no rank can tell the others what happens any more",
        )
        return RankFailure(
            f"{who} stopped answering ({self.call}): it hosts the process group's store, which cannot be reached "
            f"({how}), while rank {self.rank} waited for {what}"
        )

    def enter(self, *, rendezvous: bool) -> None:
        """Say which call this rank runs; with ``rendezvous``, wait until every rank of the group
        said the same (a ``DivergenceError`` names a rank in another call, a ``RankFailure``
        the ranks that did not join within the timeout)."""
        if self.store is None or self.world == 1:
            return
        try:
            self._write(f"{self.prefix}/enter/{self.rank}", self.call)
            if not rendezvous and self.after is None:
                return
            self._meet()
            if self.after is not None:
                self.settle(self.after)
        except _StoreUnreachable as e:
            raise self._store_gone(e, f"every rank to join {self.call}") from e.__cause__

    def _meet(self) -> None:
        started = looked = time.monotonic()
        while len(self._agreed) < self.world - 1:
            self._check_calls()
            remote = self._remote_error()
            if remote is not None:
                raise RankFailure(f"{remote}; rank {self.rank} was waiting for every rank to join {self.call}")
            now = time.monotonic()
            if now - looked >= 0.05:  # a rank that found the group out of step does not come: it says so there
                looked = now
                _look_in_store(self.group)
                ensure_usable(self.group)
            waited = now - started
            if waited >= self.timeout:
                missing = [r for r in range(self.world) if r != self.rank and r not in self._agreed]
                error = RankFailure(
                    f"{self.call} was called on rank {self.rank} of group {self.group.group_name!r}, but "
                    f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join within "
                    f"{waited:.1f} s (timeout {self.timeout:g} s): every rank of the group must make the same call"
                )
                self.publish(error)
                raise error
            time.sleep(0.01)

    def settle(self, failure: _Failure) -> None:
        """The first call after one that failed on this rank, once every rank has entered it: is
        the group still in step? Every rank is past the failed call now, so each exchange it left
        in flight has either finished (its peers did their part) or never will (a peer gave up on
        it, or never issued it: the rank that raised), and would pair with this call's. Each rank
        that failed says which; if any is stuck, every rank raises ``RankFailure`` and the group
        is remembered unusable. On failure paths only: a few store round trips."""
        deadline = time.monotonic() + min(_SETTLE, self.timeout)
        for w in failure.works:
            w.wait(max(0.0, deadline - time.monotonic()))
        stuck = [w for w in failure.works if not w.done]
        self._write(f"{self.prefix}/settled/{self.rank}", "" if not stuck else failure.gave_up or "exchanges")
        failed = [r for r in range(self.world) if r == self.rank or self._has(f"{failure.prefix}/failed/{r}")]
        reports: dict[int, str] = {}
        started = time.monotonic()
        while len(reports) < len(failed):
            remote = self._remote_error()  # (a rank that raises here said what it found first)
            for r in failed:
                if r not in reports and self._has(f"{self.prefix}/settled/{r}"):
                    reports[r] = self._read(f"{self.prefix}/settled/{r}")
            if len(reports) < len(failed):
                if remote is not None:
                    raise RankFailure(f"{remote}; rank {self.rank} was waiting for every rank to join {self.call}")
                _look_in_store(self.group)
                ensure_usable(self.group)
                if time.monotonic() - started >= self.timeout:
                    missing = ", ".join(str(r) for r in failed if r not in reports)
                    raise RankFailure(
                        f"ranks {missing} of group {self.group.group_name!r} entered {self.call} but did not say "
                        f"whether {failure.call} left collectives in flight within {self.timeout:g} s"
                    )
                time.sleep(0.01)
        stuck_on = {r: what for r, what in reports.items() if what}
        if not stuck_on:
            return
        by_what: dict[str, list[int]] = {}
        for r in sorted(stuck_on):
            by_what.setdefault(stuck_on[r], []).append(r)
        ranks = sorted(stuck_on)
        where = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: the {what}" for what, rs in by_what.items()
        )
        why = (
            f"{self._origin(failure.prefix)} in {failure.call}, and the collectives "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} had issued then never completed "
            f"({where}): they stay in flight and would pair with later ones"
        )
        _lost(self.group, [], why)
        raise RankFailure(_unusable(self.group, why))

    def _origin(self, prefix: str) -> str:
        """Who started a failure: the first rank whose own error it was (not one heard from another)."""
        errors = {r: self._read(f"{prefix}/error/{r}") for r in range(self.world) if self._has(f"{prefix}/error/{r}")}
        own = [r for r, e in errors.items() if not e.startswith(f"{RankFailure.__name__}:")]
        if own:
            return f"rank {own[0]} raised {errors[own[0]]}"
        if errors:
            r = min(errors)
            return f"rank {r} raised {errors[r]}"
        return "a rank failed"

    def _check_calls(self) -> None:
        """Raise if another rank entered a different call at this point of the program."""
        if self.store is None:
            return
        for r in range(self.world):
            if r == self.rank or r in self._agreed:
                continue
            key = f"{self.prefix}/enter/{r}"
            if not self._has(key):
                continue
            theirs = self._read(key)
            if theirs != self.call:
                raise DivergenceError(
                    f"ranks diverge: rank {self.rank} of group {self.group.group_name!r} is in {self.call} while "
                    f"rank {r} is in {theirs}; every rank must make the same calls that communicate, in the same "
                    "order"
                )
            self._agreed.add(r)

    @contextlib.contextmanager
    def active(self) -> Iterator[Guard]:
        previous = current()
        _local.guard = self
        try:
            yield self
        except BaseException as e:
            if not isinstance(e, DivergenceError):  # a divergence is found by every rank itself
                self.publish(e)
            if isinstance(e, RankFailure):
                global _heard_of_failure
                _heard_of_failure = True
            self._remember_failure()
            raise
        finally:
            _local.guard = previous

    def _remember_failure(self) -> None:
        """This call failed: the next one on the group meets the others and settles what it left in flight."""
        if self.world == 1:
            return
        earlier = self.after.works if self.after is not None else []  # (finished, if it was settled)
        pending = [w for w in (*earlier, *self.watched) if not w.done]
        _failed[self.group.group_name] = _Failure(self.prefix, self.call, pending, self.gave_up)
        _left_in_flight.extend(w for w in self.watched if w in pending)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}/failed/{self.rank}", "1")

    # --- telling the others ---------------------------------------------------------------------

    def publish(self, error: BaseException) -> None:
        """Write this rank's error where the others look while they wait."""
        if self.store is None or self.world == 1:
            return
        first = str(error).splitlines()[0] if str(error) else ""
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}/error/{self.rank}", f"{type(error).__name__}: {first}"[:500])

    def _busy(self) -> list[tuple[int, str]]:
        """The ranks that said they are in local work (``busy``) and have not said they are done."""
        found = []
        for r in range(self.world):
            key = f"{self.prefix}/busy/{r}"
            if self._has(key) and (what := self._read(key)):
                found.append((r, what))
        return found

    def _answer_roll(self) -> None:
        """Sign in as alive when a failing rank asks (``_missing``): a rank that waits on a live
        peer (with replicas: one of another shard group) does not fail itself within the grace,
        and must not be named among the ranks that stopped answering."""
        if not self._signed and self._has(f"{self.prefix}/roll"):
            self._write(f"{self.prefix}/alive/{self.rank}", "1")
            self._signed = True

    def _remote_error(self) -> str | None:
        if self.store is None:
            return None
        for r in range(self.world):
            key = f"{self.prefix}/error/{r}"
            if r != self.rank and self._has(key):
                return f"rank {r}: {self._read(key)} ({self.call})"
        return None

    def _missing(self, grace: float) -> list[int]:
        """Ranks that do not sign in within ``grace`` seconds (every live rank signs in when it fails)."""
        if self.store is None:
            return []
        self._write(f"{self.prefix}/alive/{self.rank}", "1")
        self._write(f"{self.prefix}/roll", "1")  # ranks still waiting (on live peers) answer it too
        deadline = time.monotonic() + grace
        missing = [r for r in range(self.world) if r != self.rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not self._has(f"{self.prefix}/alive/{r}")]
            time.sleep(0.02)
        return missing

    def _fail(self, what: str, cause: BaseException | None, started: float) -> RankFailure:
        try:
            return self._failure(what, cause, started)
        except _StoreUnreachable as e:
            return self._store_gone(e, f"the {what}")

    def _failure(self, what: str, cause: BaseException | None, started: float) -> RankFailure:
        remote = self._remote_error()
        if remote is not None:
            return RankFailure(f"{remote}; rank {self.rank} stopped waiting for the {what}")
        missing = self._missing(grace=min(5.0, self.timeout))
        remote = self._remote_error()
        if remote is not None:
            return RankFailure(f"{remote}; rank {self.rank} stopped waiting for the {what}")
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing else "a rank"
        waited = time.monotonic() - started
        how = (
            f"broke off ({str(cause).splitlines()[0][:200]})"
            if cause is not None
            else f"went silent: no answer for {waited:.1f} s (timeout {self.timeout:g} s)"
        )
        error = RankFailure(
            f"{who} of group {self.group.group_name!r} stopped answering ({self.call}): the connection {how} "
            f"while rank {self.rank} waited for the {what}"
        )
        _lost(
            self.group,
            missing,
            f"{who} stopped answering in {self.call} (the connection {how}); the connections to "
            f"{'them' if len(missing) > 1 else 'it'} are closed, so no collective there can complete",
        )
        return error

    # --- waiting ------------------------------------------------------------------------------------

    def wait_watched(self, watched: Watched, what: Callable[[], str]) -> None:
        """Wait for works a waiter thread blocks on (``watch``): return at once if they are done,
        else watch them, the store and the clock until they are, raising on a remote error, a
        broken connection or the timeout. Abandoned on a failure, the waiter stays blocked (a
        daemon; another takes its place): the group is unusable then."""
        if watched.done:
            self._result(watched, what)
            return
        started = time.monotonic()
        deadline = started + self.timeout
        try:
            # Wakes the moment the works finish; every 50 ms looks for other ranks' errors.
            while not watched.wait(timeout=max(0.0, min(0.05, deadline - time.monotonic()))):
                remote = self._remote_error()
                # A rank that failed just after its part of this collective: let it complete,
                # so this rank goes on to meet the failure itself (the same error on every rank).
                if remote is not None and not watched.wait(timeout=0.25):
                    self._give_up(what)
                    raise RankFailure(f"{remote}; rank {self.rank} stopped waiting for the {what()}")
                self._answer_roll()
                self._check_calls()
                if time.monotonic() >= deadline:
                    self._give_up(what)
                    raise self._fail(what(), None, started)
        except _StoreUnreachable as e:
            self._give_up(what)
            raise self._store_gone(e, f"the {what()}") from e.__cause__
        self._result(watched, what, started)

    def _give_up(self, what: Callable[[], str]) -> None:
        _abandoned()
        if self.gave_up is None:
            self.gave_up = what()

    def _result(self, watched: Watched, what: Callable[[], str], started: float | None = None) -> None:
        try:
            watched.result()
        except RuntimeError as e:  # gloo: a peer's connection closed (the rank died)
            raise self._fail(what(), e, time.monotonic() if started is None else started) from e

    def wait_polled(self, works: Sequence[Any], what: Callable[[], str]) -> None:
        """Wait for works the backend may say are done (gloo's own collectives) on this thread:
        polled for up to ``_POLL`` seconds, no hand-off; works not done by then (or whose backend
        never says, as gloo's reduce-scatter) are watched by a waiter thread (``wait_watched``)."""
        deadline = time.monotonic() + _POLL
        nap = 0.00005
        try:
            while not all(w.is_completed() for w in works):
                if time.monotonic() >= deadline:
                    self.wait_watched(watch(works), what)
                    return
                time.sleep(nap)  # a collective of a few numbers takes ~0.1-0.3 ms
                nap = min(2 * nap, 0.0005)
            for w in works:
                w.wait()  # done: raises its error, if it failed
        except RuntimeError as e:  # gloo: a peer's connection closed (the rank died)
            if isinstance(e, RankFailure | DivergenceError):
                raise
            raise self._fail(what(), e, time.monotonic()) from e

    # --- check mode ----------------------------------------------------------------------------------

    def before(self, op: str, unit: str | None, numel: int, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        """Check mode: all ranks of ``group`` agree on the collective they are about to issue."""
        self.issued.append((op, unit, numel, dtype))
        if not self.check or group.size() == 1:
            return
        mine = (len(self.issued), op, unit, numel, str(dtype))
        digest = int.from_bytes(hashlib.sha256(repr(mine).encode()).digest()[:7], "little")
        out = torch.empty(group.size(), dtype=torch.int64)
        work = dist.all_gather_single(out, torch.tensor([digest]), group=group, async_op=True)
        self.wait_polled([work], lambda: f"schedule check before the {describe(op, unit)}")
        if bool((out == digest).all()):
            return
        everyone: list[Any] = [None] * group.size()
        dist.all_gather_object(everyone, mine, group=group)
        by_value: dict[str, list[int]] = {}
        for r, desc in enumerate(everyone):
            n, o, u, k, d = desc
            by_value.setdefault(f"collective #{n}: the {describe(o, u)} ({k} elements, {d})", []).append(r)
        parts = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} would issue {v}" for v, rs in by_value.items()
        )
        raise DivergenceError(
            f"ranks diverge in step {self.step}: {parts}. Every rank must run the same units in the same order "
            "(call every unit on every rank, even on an empty batch) with the same number of micro-batches"
        )

    def fingerprint(self) -> tuple[float, float]:
        """The collectives issued so far as two exact float64 numbers (24 bits each)."""
        h = int.from_bytes(hashlib.sha256(repr(self.issued).encode()).digest()[:6], "little")
        return float(h & 0xFFFFFF), float(h >> 24)

    def compare(self, fingerprints: torch.Tensor, consequence: str) -> None:
        """Raise on every rank unless every rank issued the same collectives (``fingerprints``: W x 2)."""
        if bool((fingerprints == fingerprints[0]).all()):
            return
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, self.issued, group=self.group)
        at = next(i for i in range(max(map(len, everyone))) if len({repr(s[i : i + 1]) for s in everyone}) > 1)
        by_value: dict[str, list[int]] = {}
        for r, issued in enumerate(everyone):
            seen = f"the {describe(issued[at][0], issued[at][1])}" if at < len(issued) else "nothing more"
            by_value.setdefault(seen, []).append(r)
        parts = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} issued {v}" for v, rs in by_value.items()
        )
        raise DivergenceError(
            f"ranks diverged in step {self.step} at collective #{at + 1}: {parts}. Every rank must run the same "
            "units in the same order (call every unit on every rank, even on an empty batch) with the same number "
            f"of micro-batches; {consequence}"
        )


class Watched:
    """Works a waiter thread blocks on from the moment they are issued (gloo's point-to-point
    works cannot be polled, and a blocked wait cannot be interrupted): when the step's thread
    comes to wait for them they are often done already, and it only reads a flag."""

    __slots__ = ("_held", "done", "error", "works")

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = works
        self.error: BaseException | None = None
        self.done = False
        self._held = _allocate_lock()  # held until the works are done: waiting is acquiring it
        self._held.acquire()
        guard = getattr(_local, "guard", None)
        if guard is not None:  # (what a failure of the call leaves in flight)
            guard.watched.append(self)
        _waiters().put(self)

    def run(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except BaseException as e:
            self.error = e
        self.works = ()
        self.done = True
        self._held.release()

    def wait(self, timeout: float) -> bool:
        """Whether the works are done, waiting up to ``timeout`` seconds for them."""
        if self.done:
            return True
        if self._held.acquire(timeout=timeout):
            self._held.release()  # (for any other wait on it)
            return True
        return False

    def result(self) -> None:
        if self.error is not None:
            raise self.error


_jobs: queue.SimpleQueue[Watched] | None = None


def _waiters() -> queue.SimpleQueue[Watched]:
    global _jobs
    if _jobs is None:
        _jobs = queue.SimpleQueue()
        _start_waiter(_jobs)
    return _jobs


def _start_waiter(jobs: queue.SimpleQueue[Watched]) -> None:
    threading.Thread(target=_serve, args=(jobs,), daemon=True, name="fsdp_fn-wait").start()


def _abandoned() -> None:
    """A wait was given up on a failure: its waiter may stay blocked on it forever, so one more
    serves the works issued after it (those of other groups, say)."""
    if _jobs is not None:
        _start_waiter(_jobs)


def _serve(jobs: queue.SimpleQueue[Watched]) -> None:
    while True:
        jobs.get().run()


def _end_waits_at_exit() -> None:
    """At exit, end the waits failed calls left blocked, while Python still runs threads.

    Otherwise the process group is torn down while Python finalizes, the blocked wait returns,
    and its waiter thread, taking the GIL back, is ended by CPython (3.11) with ``pthread_exit``
    through pybind11's ``noexcept`` GIL guard: ``std::terminate``, a process that aborts after
    it has finished. Destroying the groups now fails those waits at once; only after a failure."""
    blocked = [w for w in _left_in_flight if not w.done]
    for w in blocked:
        for work in w.works:
            # gloo's timed wait on a point-to-point work that times out closes every pair of the
            # group: the blocked wait fails at once (the group is unusable already)
            with contextlib.suppress(Exception):
                work.wait(datetime.timedelta(milliseconds=1))
    deadline = time.monotonic() + 2.0
    for w in blocked:
        w.wait(max(0.0, deadline - time.monotonic()))


atexit.register(_end_waits_at_exit)


def _forget_waiters() -> None:
    global _jobs
    _jobs = None  # a forked child has no waiter thread: it starts its own


os.register_at_fork(after_in_child=_forget_waiters)


class _Finished:
    """A work (for ``Watched``) that is done when a thread has finished."""

    __slots__ = ("event",)

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.wait()


_beside: dict[int, Guard] = {}  # a run_guarded worker thread -> the guard of its call


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark this rank as doing local work (``what``: "writing its data") inside a
    ``run_guarded`` call, in the call's store: if the others time out meanwhile, they name it
    (its own waiting thread still answers, so it would not be missing). Outside one: nothing.
    Communication: two store writes."""
    guard = _beside.get(threading.get_ident())
    if guard is None or guard.store is None:
        yield
        return
    key = f"{guard.prefix}/busy/{guard.rank}"
    with contextlib.suppress(Exception):
        guard.store.set(key, what)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            guard.store.set(key, "")


def run_guarded(group: dist.ProcessGroup, call: str, timeout: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (collectives fsdp_fn does not issue itself: DCP's) on a thread of its own
    while this one waits under a guard: a rank that dies or goes silent in them becomes a
    ``RankFailure`` naming it within ``timeout`` (plus the grace), on every rank, and the group
    is remembered lost; ``fn``'s own exception (a full disk) is raised as it is. A silent
    rank's thread is abandoned blocked (a daemon); the group is unusable then. Memory and
    communication: ``fn``'s."""
    if group.size() == 1:
        return fn()
    done, out = threading.Event(), {}

    what = f"{call}'s collectives"
    guard = Guard(group, 0, timeout=timeout, check=False, call=call)

    def run() -> None:
        _beside[threading.get_ident()] = guard
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e
        finally:
            _beside.pop(threading.get_ident(), None)
            done.set()

    with guard.active():
        started = time.monotonic()
        threading.Thread(target=run, daemon=True, name="fsdp_fn-guarded").start()
        try:
            guard.wait_watched(watch([_Finished(done)]), lambda: what)
        except RankFailure as e:
            stuck = guard._busy() if "went silent" in str(e) else []
            if stuck:  # every rank answers, but these are still in their own work
                doing = "; ".join(f"rank {r} {w}" for r, w in stuck)
                raise RankFailure(
                    f"rank{'s' if len(stuck) > 1 else ''} {', '.join(str(r) for r, _ in stuck)} of group "
                    f"{group.group_name!r} went silent ({call}: {doing}): no answer for "
                    f"{time.monotonic() - started:.1f} s (timeout {timeout:g} s) while rank {guard.rank} waited "
                    f"for the {what}"
                ) from e
            raise
        error = out.get("error")
        # gloo's own words for a peer gone inside the collectives (DCP reports the rest itself)
        if error is not None and _is_connection_error(error):
            raise guard._fail(what, error, started) from error
        if error is not None:
            raise error
    return out.get("value")


def _is_connection_error(e: BaseException) -> bool:
    """gloo's words for a peer's connection gone, in ``e`` or in a failure DCP gathered into it."""
    found = [e, *getattr(e, "failures", {}).values()]
    words = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    return any(isinstance(x, RuntimeError) and any(w in str(x) for w in words) for x in found)


def failed_to_issue(what: Callable[[], str], cause: RuntimeError) -> RankFailure:
    """The error of a collective the backend refused to issue (gloo: a peer already dead):
    under a guard, its ``RankFailure`` naming the ranks that do not answer, and the group
    remembered lost, so the next call fails at once; outside one, a ``RankFailure`` with the
    backend's words."""
    guard = current()
    if guard is not None:
        return guard._fail(what(), cause, time.monotonic())
    return RankFailure(f"the {what()} could not be issued: {str(cause).splitlines()[0][:200]}")


def watch(works: Sequence[Any]) -> Watched:
    """Have a waiter thread block on ``works`` from now on (see ``Watched``)."""
    return Watched(works)


@contextlib.contextmanager
def guarded(
    group: dist.ProcessGroup, call: str, timeout: float, *, check: bool = False, rendezvous: bool = True
) -> Iterator[Guard | None]:
    """Run a call that communicates outside a step under a guard: every wait in it is guarded
    (``check``: in check mode, ranks agree before every collective), and with ``rendezvous``
    every rank of ``group`` must first enter the same call (within ``timeout``; one round trip
    through the store). Without it a rank in another call is found by the first wait it
    stalls, as in a train step after its checked first step. Inside an already guarded call
    (a step, say) that guard goes on."""
    if current() is not None or group.size() == 1:
        yield current()
        return
    guard = Guard(group, 0, timeout=timeout, check=check, call=call)
    with guard.active():
        guard.enter(rendezvous=rendezvous)
        yield guard


def join(group: dist.ProcessGroup, call: str, timeout: float) -> None:
    """Wait until every rank of ``group`` has entered ``call`` (a ``RankFailure`` names the ranks
    that did not within ``timeout``; a ``DivergenceError`` a rank in another call). For calls
    whose collectives run elsewhere (DCP's), so a rank that calls alone is named, not hung."""
    with guarded(group, call, timeout):
        pass
