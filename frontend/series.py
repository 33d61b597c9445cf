"""Prometheus series whose labelled children are found with one dictionary lookup.

`prometheus_client`'s `labels()` converts every value to a string, checks the count and takes a
lock on each call, ~1 us; the gateway makes some fifteen such calls a request. These classes look
the child up first in the series' own map of children (the library's, so `remove` and `clear`
keep it true) and leave every other case, a first use or values that are not strings, to the
library.
"""

from __future__ import annotations

from typing import Any

import prometheus_client


class _FoundChildren:
    def labels(self, *values: Any, **by_name: Any) -> Any:
        if not by_name:
            child = self._metrics.get(values)  # type: ignore[attr-defined]  # the library's children
            if child is not None:
                return child
        return super().labels(*values, **by_name)  # type: ignore[misc]


class Counter(_FoundChildren, prometheus_client.Counter):
    """A prometheus Counter (see the module)."""


class Gauge(_FoundChildren, prometheus_client.Gauge):
    """A prometheus Gauge (see the module)."""


class Histogram(_FoundChildren, prometheus_client.Histogram):
    """A prometheus Histogram (see the module)."""
