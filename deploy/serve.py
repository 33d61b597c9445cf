"""`splitserve up`: start a deployment in the foreground and stop it on Ctrl-C or SIGTERM.

While it runs, `up` holds its deployment's name on this machine and, once the deployment is
healthy, records where it runs (`deploy.local_deployments`), so `splitserve status` and `resize`
find this deployment and no other.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

from deploy.launcher import ClusterError, ClusterHandle, run_cluster
from deploy.local_deployments import DEFAULT_NAME, DeploymentClaim, DeploymentRecord
from deploy.ray_connection import attached_to_lost_ray
from deploy.report import status_line
from deploy.stop_signals import STOP_SIGNALS, StopSignals
from splitserve.config import ClusterConfig


def serve_forever(
    config: ClusterConfig,
    *,
    address: str | None = None,
    name: str = DEFAULT_NAME,
    poll_s: float | None = None,
) -> int:
    """Run deployment `name` until SIGINT or SIGTERM, printing a status line whenever it changes;
    return 0 then (1 if it could not start or was lost).

    The first signal during startup interrupts it (and `run_cluster` ends whatever it had
    started); later ones are ignored, so they cannot cut that cleanup short. Once the cluster
    is up a signal only wakes the wait, so the shutdown itself is never interrupted.

    A signal to the whole process group ends the local Ray together with this process. Once
    everything of ours is done, the process then exits at once: Ray's own exit hook would wait
    on the dead Ray for seconds, or end the process from inside Ray with another status.
    """
    status = _serve(config, address=address, name=name, poll_s=poll_s)
    if attached_to_lost_ray():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _serve(config: ClusterConfig, *, address: str | None, name: str, poll_s: float | None) -> int:

    def interrupt(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    cluster: ClusterHandle | None = None
    claim: DeploymentClaim | None = None
    try:
        claim = DeploymentClaim(name)
        print(
            f"starting splitserve {name!r} ({config.mode}, model {config.model.served_name})...", flush=True
        )
        cluster = run_cluster(config, address=address, name=name)
        with StopSignals() as stop:
            poll_s = poll_s if poll_s is not None else config.health.interval_s
            record = _recorder(claim, cluster)
            return _watch(cluster, stop, poll_s, config.health.drain_timeout_s, record)
    except KeyboardInterrupt:  # during startup, or just after it, before StopSignals took over
        if cluster is not None:
            cluster.stop()
        print("interrupted during startup; stopped", file=sys.stderr)
        return 0
    except ClusterError as exc:
        print(f"splitserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        if claim is not None:
            claim.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _recorder(claim: DeploymentClaim, cluster: ClusterHandle) -> Callable[[str], None]:
    """Records the running deployment (given its gateway url) where `status` and `resize` look."""

    def record(gateway_url: str) -> None:
        claim.publish(
            DeploymentRecord(
                name=claim.name,
                namespace=cluster.namespace,
                address=cluster.address,
                gateway_url=gateway_url,
                pid=os.getpid(),
                started_ray=cluster.started_ray,
            )
        )

    return record


def _watch(
    cluster: ClusterHandle,
    stop: StopSignals,
    poll_s: float,
    drain_timeout_s: float,
    record: Callable[[str], None],
) -> int:
    status = 1
    try:
        current = cluster.status()
        print(f"gateway: {current['gateway']['url']}/v1", flush=True)
        record(current["gateway"]["url"])
        line = status_line(current)
        print(line, flush=True)
        while not stop.wait(poll_s):
            current = cluster.status()
            if status_line(current) != line:
                line = status_line(current)
                print(line, flush=True)
        status = 0
    except Exception as exc:  # the controller or the Ray cluster went away under us
        if stop.wait(0):  # ...because the stop signal ended it too (SIGTERM to the process group)
            status = 0
        else:
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
