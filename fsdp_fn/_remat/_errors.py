"""The error a rematerialised region raises when it cannot run as asked."""

from __future__ import annotations


class RematError(RuntimeError):
    """A rematerialised region cannot run as asked; the message names the call and the fix."""
