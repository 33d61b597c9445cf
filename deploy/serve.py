"""`splitserve up`: start a deployment in the foreground and stop it on Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import sys
from types import FrameType

from deploy.launcher import ClusterError, ClusterHandle, run_cluster
from deploy.report import status_line
from deploy.stop_signals import STOP_SIGNALS, StopSignals
from splitserve.config import ClusterConfig


def serve_forever(config: ClusterConfig, *, address: str | None = None, poll_s: float | None = None) -> int:
    """Run until SIGINT or SIGTERM, printing a status line whenever it changes; return 0 then.

    The first signal during startup interrupts it (and `run_cluster` ends whatever it had
    started); later ones are ignored, so they cannot cut that cleanup short. Once the cluster
    is up a signal only wakes the wait, so the shutdown itself is never interrupted.
    """

    def interrupt(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    cluster: ClusterHandle | None = None
    try:
        print(f"starting splitserve ({config.mode}, model {config.model.served_name})...", flush=True)
        cluster = run_cluster(config, address=address)
        with StopSignals() as stop:
            poll_s = poll_s if poll_s is not None else config.health.interval_s
            return _watch(cluster, stop, poll_s, config.health.drain_timeout_s)
    except KeyboardInterrupt:  # during startup, or just after it, before StopSignals took over
        if cluster is not None:
            cluster.stop()
        print("interrupted during startup; stopped", file=sys.stderr)
        return 0
    except ClusterError as exc:
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(cluster: ClusterHandle, stop: StopSignals, poll_s: float, drain_timeout_s: float) -> int:
    status = 1
    try:
        current = cluster.status()
        print(f"gateway: {current['gateway']['url']}/v1", flush=True)
        line = status_line(current)
        print(line, flush=True)
        while not stop.wait(poll_s):
            current = cluster.status()
            if status_line(current) != line:
                line = status_line(current)
                print(line, flush=True)
        status = 0
    except Exception as exc:  # the controller or the Ray cluster went away under us
        print(f"splitserve up: lost the controller ({type(exc).__name__}: {exc})", file=sys.stderr)
    finally:
        print(
            f"stopping: no new requests; those in flight get up to {drain_timeout_s:g} s to finish...",
            file=sys.stderr,
            flush=True,
        )
        cluster.stop()
        print("stopped", file=sys.stderr, flush=True)
    return status
