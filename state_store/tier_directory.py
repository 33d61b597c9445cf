"""A disk tier's private directory: claimed with a lock its process holds while it lives.

A store that dies without `close()` (SIGKILL, OOM, a node reboot) leaves its directory and
every object file in it behind. Each directory therefore holds a `.owner` file that its store
keeps open under an exclusive `flock`; the kernel drops that lock when the process dies,
whatever killed it. A new disk tier deletes every sibling directory whose lock it can take,
so leftovers from dead stores on the node are reclaimed at the next start, and a directory
whose store is alive (in this process or another) is never touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "splitserve-tier-"
OWNER_FILE = ".owner"


class ClaimedDirectory:
    """Owns a fresh directory under `root` and the lock that says its owner is alive."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
        # Lock under a temporary name, then rename: a scanner never sees an unlocked .owner.
        claiming = self.path / f"{OWNER_FILE}.{os.getpid()}"
        self._fd: int | None = os.open(claiming, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(claiming, self.path / OWNER_FILE)

    def release(self) -> None:
        """Delete the directory and drop the lock; idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def reclaim_abandoned(root: str | os.PathLike[str]) -> int:
    """Delete the tier directories under `root` whose owner has died; the bytes freed."""
    freed_bytes = 0
    for directory in sorted(Path(root).glob(f"{PREFIX}*")):
        owner = directory / OWNER_FILE
        try:
            fd = os.open(owner, os.O_RDWR)
        except OSError:  # no owner file: being created right now, or not ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its store is alive
            os.close(fd)
            continue
        try:
            size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
            shutil.rmtree(directory, ignore_errors=True)
            freed_bytes += size
            logger.warning("reclaimed %d bytes left in %s by a store that died", size, directory)
        finally:
            os.close(fd)
    return freed_bytes
