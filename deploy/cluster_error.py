"""The one error a deployment command reports to its user: start, find, attach, stop."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The deployment could not be started, found or reached: the message says why and what to do."""
