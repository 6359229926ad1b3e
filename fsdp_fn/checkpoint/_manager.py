"""``CheckpointManager``: one run's checkpoints under a directory, the last K kept, the newest that loads restored."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from fsdp_fn._shard import Layout
from fsdp_fn._step import TrainState
from fsdp_fn.checkpoint._background import PendingSave, wait
from fsdp_fn.checkpoint._directory import is_committed
from fsdp_fn.checkpoint._integrity import CheckpointError
from fsdp_fn.checkpoint._load import load
from fsdp_fn.checkpoint._ranks import _group
from fsdp_fn.checkpoint._save import save

logger = logging.getLogger("fsdp_fn.checkpoint")  # the package's logger, as docs/checkpoints.md names it


_STEP_DIR = re.compile(r"step_(\d{8,})")


class CheckpointManager:
    """Checkpoints of one run under ``root`` (``root/step_00000100``), the last ``keep`` kept.

    ``save(state)`` names the directory after ``state.step`` (or ``step=``); once it is committed,
    rank 0 deletes the oldest of its own step directories beyond ``keep`` (and the temporary
    directories its interrupted saves left). Nothing else under ``root`` is its own: a
    checkpoint saved there by hand (``root/best``) is never deleted, nor restored.
    ``restore(like)`` loads the newest of its checkpoints that loads, or returns ``None``
    when there is none; ``skipped`` then lists the newer ones it passed over, and why.
    Making one touches no file and communicates nothing.

    Args:
        root: the directory the run's checkpoints go under (made by the first save).
        keep: how many of its newest checkpoints to keep; ``None`` keeps every one.

    Attributes:
        skipped: ``(directory, why)`` of each checkpoint the last ``restore`` passed over,
            newest first.

    Raises:
        ValueError: if ``keep`` is less than 1.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int | None = 3) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep every checkpoint), got {keep!r}")
        self.root, self.keep = Path(root), keep
        self._prune_after: Layout | None = None
        self.skipped: list[tuple[Path, str]] = []  # by the last restore: (directory, why), newest first

    def directory(self, step: int) -> Path:
        """Where the checkpoint of ``step`` goes: ``root/step_NNNNNNNN`` (eight digits at least).

        Args:
            step: the step the checkpoint is named after.

        Returns:
            The path; nothing is made or read.
        """
        return self.root / f"step_{step:08d}"

    def _own(self) -> list[tuple[int, Path]]:
        """(step, directory) of this manager's committed checkpoints (named by ``directory``), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            named = _STEP_DIR.fullmatch(d.name)
            if named and d == self.directory(int(named[1])) and is_committed(d):
                found.append((int(named[1]), d))
        return sorted(found)

    def steps(self) -> list[int]:
        """The steps of its complete checkpoints (their directories' names), oldest first.

        Returns:
            A list of steps; empty when it has none.
        """
        return [n for n, _ in self._own()]

    def latest(self) -> Path | None:
        """Its newest complete checkpoint (``restore`` falls back from it if it does not load).

        Returns:
            The checkpoint's directory, or ``None`` when it has none.
        """
        own = self._own()
        return own[-1][1] if own else None

    def save(
        self, state: TrainState, *, step: int | None = None, extra: Any = None, blocking: bool = True, **kwargs: Any
    ) -> PendingSave | Path:
        """``save(root/step_N, state, ...)``, then the retention.

        With ``blocking=False`` the retention runs too, once the background save is waited
        for (by the next ``save``, or ``wait()``). ``N`` is ``step``, by default
        ``state.step``: the steps applied, which a step that ``apply_if_finite`` skipped
        leaves as it was; a loop that saves every K calls names its checkpoints after its
        own count (``step=k + 1``). Memory and communication: ``save``'s; the retention,
        on rank 0, deletes directories and communicates nothing.

        Args:
            state: the ``TrainState`` to save.
            step: the step the checkpoint is named after; ``None``: ``state.step``.
            extra: what to save beside the state, as in ``save``.
            blocking: ``False`` saves in the background, as in ``save``.
            **kwargs: the rest of ``save``'s options (``hyperparams``, ``timeout``).

        Returns:
            What ``save`` returns: the checkpoint's path, or a ``PendingSave``.

        Raises:
            CheckpointError: if the step is not a whole number >= 0; also what ``save``
                raises, and the failure of the previous background save.
        """
        self.wait()  # the previous background save, then its retention
        n = state.step if step is None else step
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CheckpointError(f"CheckpointManager.save: step must be a whole number >= 0, got {n!r}")
        result = save(self.directory(n), state, extra=extra, blocking=blocking, **kwargs)
        if isinstance(result, Path):
            self._prune(state.params.layout)
        else:
            self._prune_after = state.params.layout
        return result

    def wait(self) -> Path | None:
        """Wait for the background save, if any (raising its failure), then apply the retention.

        Returns:
            The directory of the save waited for, or ``None`` when none was pending.

        Raises:
            CheckpointError: if that save failed (no checkpoint is deleted then).
        """
        done = wait()
        layout, self._prune_after = self._prune_after, None
        if done is not None and layout is not None:
            self._prune(layout)
        return done

    def _prune(self, layout: Layout) -> None:
        if _group(layout).rank() != 0 or self.keep is None:
            return
        for _, d in self._own()[: -self.keep]:
            shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob(".step_*.tmp"):  # left by its saves that were killed
            named = _STEP_DIR.fullmatch(d.name[1:-4])
            if named and d.name == f".{self.directory(int(named[1])).name}.tmp":
                shutil.rmtree(d, ignore_errors=True)

    def restore(
        self, like: TrainState, *, check_digests: bool = True, timeout: float = 300.0
    ) -> tuple[TrainState, Any] | None:
        """``load`` the newest of its checkpoints that loads into ``like``; ``None`` when it has none.

        A checkpoint that does not load (damaged, a file missing, a flipped bit) is skipped
        for the one before it: each skipped one is logged (``fsdp_fn.checkpoint``, warning)
        and kept in ``skipped`` with why. When none loads, ``CheckpointError`` lists each and
        why; ``like``'s tensors may then hold part of what was read. Memory and
        communication: ``load``'s, once per checkpoint tried.

        Args:
            like: a ``TrainState`` for the target run, as in ``load``.
            check_digests: ``False`` skips checking each chunk read against its digest.
            timeout: seconds to wait for every rank to call ``load``.

        Returns:
            The state and ``extra`` of the newest of its checkpoints that loads, as ``load``
            returns them, or ``None`` when it has no checkpoint.

        Raises:
            CheckpointError: if none of its checkpoints loads, listing each and why.
            TypeError: if ``like`` is not a ``TrainState`` (found at the first checkpoint
                tried); ``load``'s other errors (``RuntimeError``, ``ValueError``,
                ``RankFailure``, ``DivergenceError``) pass through too: only a checkpoint
                that does not load is skipped.
        """
        self.skipped = []
        own = self._own()
        for _, path in reversed(own):
            try:
                restored = load(path, like, check_digests=check_digests, timeout=timeout)
            except CheckpointError as e:
                why = str(e).splitlines()[0]
                self.skipped.append((path, why))
                logger.warning("CheckpointManager.restore skipped %s: %s", path, why)
                continue
            if self.skipped:
                logger.warning(
                    "CheckpointManager.restore loaded %s, skipping %d newer: %s",
                    path,
                    len(self.skipped),
                    ", ".join(p.name for p, _ in self.skipped),
                )
            return restored
        if self.skipped:
            reasons = "; ".join(f"{p.name}: {why}" for p, why in self.skipped)
            raise CheckpointError(f"none of the {len(own)} checkpoints under {self.root} loads: {reasons}")
        return None
