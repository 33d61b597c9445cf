"""Shared mappings of a file that keep no file descriptor open.

CPython's `mmap.mmap(fd, ...)` dup()s the descriptor and holds it as long as the mapping lives
(3.11 has no `trackfd=False`), so a process holding one mapping per arena region holds one open
file per region: a store retaining thousands of prefixes ran past RLIMIT_NOFILE. The kernel needs
no descriptor to keep a mapping, so `map_file` calls libc's `mmap` directly; the caller closes
its descriptor right after, and the open-file count no longer depends on the number of mappings.

Lifetime is the same as `mmap.mmap`'s: the pages are unmapped exactly once, when the last
memoryview (or numpy array) over them is dropped, never while one is still in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref

import numpy as np


def _load_libc_mmap() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    """libc's (mmap, munmap), or None where they cannot be called (then `mmap.mmap` is used)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        c_mmap, c_munmap = libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None
    c_mmap.restype = ctypes.c_void_p
    c_mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    c_munmap.restype = ctypes.c_int
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return c_mmap, c_munmap


_LIBC = _load_libc_mmap()
_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere pages fault in on use


class _Pages:
    """Owns one mapping's address range: numpy arrays over it keep it alive (as their base), and
    it is unmapped when the last of them is gone."""

    def __init__(self, address: int, num_bytes: int, writable: bool) -> None:
        self.__array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, not writable),
            "version": 3,
        }
        assert _LIBC is not None
        finalizer = weakref.finalize(self, _LIBC[1], address, num_bytes)
        finalizer.atexit = False  # a view still used at exit (a daemon thread's) must stay mapped


def map_file(fd: int, num_bytes: int, *, writable: bool, populate: bool = False) -> memoryview:
    """The first `num_bytes` of the file open as `fd`, mapped shared, as a byte memoryview
    (read-only unless `writable`; `fd` must be open for writing then). `populate` maps every page
    now (MAP_POPULATE), not one fault per 4 KiB later. The caller may close `fd` at once.
    Raises OSError if the kernel refuses the mapping."""
    if num_bytes == 0:
        return memoryview(b"")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | (MAP_POPULATE if populate else 0)
    if _LIBC is None:  # no callable libc: the dup()ing mmap module, one open file per mapping
        view = memoryview(mmap.mmap(fd, num_bytes, flags=flags, prot=prot))
        return view if writable else view.toreadonly()
    address = _LIBC[0](None, num_bytes, prot, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {num_bytes} bytes failed: {os.strerror(errno)}")
    return np.asarray(_Pages(address, num_bytes, writable)).data  # the array (and so _Pages) is its base
