"""Two hosts on this machine: network namespaces joined by a veth pair, each with its own address.

A network namespace has its own interfaces, addresses, routes and ports, so a process started in
one (`ip netns exec NAME ...`) sees only its host's address and reaches the other host over the
veth link, as two machines on one subnet would; files and processes stay shared. Making them
needs root and iproute2: `missing_privilege()` says what is missing, for a skip.

`two_hosts()` creates both namespaces and the link and, however the block ends, SIGKILLs every
process still in either namespace (each was started inside one by the test) and deletes them;
the veth pair goes with them. Names carry this process's pid, so two runs at once do not meet,
and nothing is added to the machine's own namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.77.0"
_KILL_WAIT_S = 30.0


@dataclass(frozen=True)
class Host:
    """One namespace as a host: its name, its address on the link, and its processes."""

    netns: str
    ip: str

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Every process in this host (what the test started there, and their children)."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False)
        return [int(pid) for pid in out.stdout.split()]

    def kill_everything(self) -> list[int]:
        """SIGKILL every process in this host until none is left (a lost host); return the pids."""
        killed: list[int] = []
        deadline_s = time.monotonic() + _KILL_WAIT_S
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += [pid for pid in pids if pid not in killed]
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"processes {pids} of {self.netns} outlived SIGKILL for {_KILL_WAIT_S} s")
            time.sleep(0.05)  # the kernel ends them asynchronously: look again
        return killed


def missing_privilege() -> str | None:
    """Why this process cannot make network namespaces, or None when it can."""
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to make network namespaces"
    if os.geteuid() != 0:
        return f"needs root to make network namespaces (running as uid {os.geteuid()})"
    probe = f"ssprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Hosts a (SUBNET.1) and b (SUBNET.2) on one veth link; both deleted afterwards."""
    tag = f"ss{os.getpid()}"
    a, b = Host(f"{tag}a", f"{SUBNET}.1"), Host(f"{tag}b", f"{SUBNET}.2")
    made: list[Host] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.netns)
            made.append(host)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for host, link in ((a, f"{tag}va"), (b, f"{tag}vb")):
            _ip("link", "set", link, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", link)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", link, "up")
            # a default route gives the host a source address for any destination: Ray finds its
            # node's IP by the route to a public address (never sent to)
            _ip("-n", host.netns, "route", "add", "default", "dev", link)
        yield a, b
    finally:
        for host in made:
            with contextlib.suppress(RuntimeError):
                host.kill_everything()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(argv)}` failed: {done.stderr.strip()}")
