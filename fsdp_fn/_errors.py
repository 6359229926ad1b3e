"""The errors ranks raise when they cannot go on together."""

from __future__ import annotations


class DivergenceError(RuntimeError):
    """Ranks of one group disagree about something every rank must share (plan, schedule, call, ...)."""


class RankFailure(RuntimeError):
    """Another rank failed (raised, died, went silent or never joined) while this rank waited on it."""
