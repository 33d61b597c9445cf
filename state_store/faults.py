"""Faults injected into a store's Put path, for the fault tests (tests/faults/) only.

Inert unless the environment variable `SPLITSERVE_FAULT_STORE` names a JSON file when the
store's servicer is made; never set it in a deployment. The file is read again whenever it
changes, so one running cluster can go through several faults, and may hold:

* `"fail_every": N`: every Nth chunk a Put commits ends that Put with UNAVAILABLE, as a broken
  transfer would (the writer's request then fails; the store keeps nothing new of it);
* `"flip_every": N` with `"flip_kind"` ("mla_kv", "kda_conv", "kda_recurrent" or "" for any):
  one byte of every Nth such chunk is flipped before the store takes it (in the message, or in
  the shared-memory region the writer filled), so whoever checks its checksum next must refuse it;
* `"hold_puts": true`: every chunk waits until the file no longer says so (a stalled transfer,
  so a test can act while a request's state is on its way);
* `"key_prefix": "..."`: only keys that start with it are touched (e.g. a decode worker's
  request keys, not the prefixes a prefill retains).

Counters restart whenever the file changes. Each fault is appended to `<file>.log` as one line,
"fail <key>", "flip <kind> <key>" or "hold <key>" (once per key), so a test knows what it hit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from splitserve.state.wire import KIND_FROM_PROTO, is_seal, meta_from_proto
from splitserve.v1 import common_pb2

ENV_VAR = "SPLITSERVE_FAULT_STORE"


@dataclass(frozen=True)
class FaultSpec:
    """What to break; 0 turns a fault off."""

    fail_every: int = 0
    flip_every: int = 0
    flip_kind: str = ""
    hold_puts: bool = False
    key_prefix: str = ""

    @classmethod
    def parse(cls, text: str, path: str) -> FaultSpec:
        fields = json.loads(text or "{}")
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown fault keys {sorted(unknown)}; see state_store/faults.py")
        return cls(**fields)


class StoreFaults:
    """Owns the fault file's current spec, its counters and its log. Thread-safe."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._spec = FaultSpec()
        self._num_chunks = 0
        self._num_flippable = 0
        self._held_keys: set[str] = set()

    @classmethod
    def from_env(cls) -> StoreFaults | None:
        path = os.environ.get(ENV_VAR)
        return cls(path) if path else None

    async def before_chunk(self, msg: common_pb2.StateChunk, arena_directory: Path | None) -> str | None:
        """Applies the spec to one Put message: waits while puts are held, flips a byte in place if
        it is due, and returns why the Put must fail now, or None to go on."""
        if is_seal(msg):
            return None
        with self._lock:
            if not msg.key.startswith(self._reload_locked().key_prefix):
                return None
        while self._holding(msg.key):
            await asyncio.sleep(0.05)  # polls the file: a test hook, never armed in a deployment
        with self._lock:
            spec = self._reload_locked()
            self._num_chunks += 1
            if spec.fail_every and self._num_chunks % spec.fail_every == 0:
                self._log(f"fail {msg.key}")
                return f"injected fault: store operation {self._num_chunks} on key {msg.key!r} failed"
            kind = KIND_FROM_PROTO.get(msg.kind)
            if not spec.flip_every or kind is None or spec.flip_kind not in ("", kind.value):
                return None
            self._num_flippable += 1
            if self._num_flippable % spec.flip_every:
                return None
            self._log(f"flip {kind.value} {msg.key}")
        _flip_one_byte(msg, arena_directory)
        return None

    def _holding(self, key: str) -> bool:
        with self._lock:
            if not self._reload_locked().hold_puts:
                return False
            if key not in self._held_keys:
                self._held_keys.add(key)
                self._log(f"hold {key}")
            return True

    def _reload_locked(self) -> FaultSpec:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return FaultSpec()
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            self._spec = FaultSpec.parse(Path(self.path).read_text(), self.path)
            self._num_chunks = self._num_flippable = 0
            self._held_keys.clear()
        return self._spec

    def _log(self, line: str) -> None:
        with open(f"{self.path}.log", "a") as log:
            log.write(line + "\n")


def _flip_one_byte(msg: common_pb2.StateChunk, arena_directory: Path | None) -> None:
    """Flips the middle byte of the chunk's bytes, wherever they are (message or arena region)."""
    if msg.region and arena_directory is not None:
        at = msg.region_offset + meta_from_proto(msg).num_bytes // 2
        fd = os.open(arena_directory / msg.region, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
        finally:
            os.close(fd)
    elif msg.data:
        at = len(msg.data) // 2
        msg.data = msg.data[:at] + bytes([msg.data[at] ^ 0x01]) + msg.data[at + 1 :]
