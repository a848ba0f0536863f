"""Which pages of a node's relation files the kernel's page cache holds, page by page, so that
two nodes' caches can be compared: a relation has the same file on a primary and on its
physical standby. mincore(2) over a read-only shared mapping, as the extension's
ccm_os_cached_blocks does; no page is touched, so nothing is read or made hot.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections import Counter
from pathlib import Path
from typing import Callable

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_MAP_FAILED = ctypes.c_void_p(-1).value

# Relation file (relative to the data directory) -> one byte per OS page, bit 0 set when the
# page cache holds the page.
Residency = dict[str, bytes]


def residency(path: Path) -> bytes:
    """One byte per OS page of the file, bit 0 set when resident; empty for an empty or
    vanished file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            vector = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return vector.raw
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def relation_files(datadir: Path) -> list[str]:
    """The data files of every database (base/<db>/<file>), relative to the data directory."""
    base = datadir / "base"
    return [f"base/{db.name}/{f.name}" for db in sorted(base.iterdir()) if db.is_dir()
            for f in sorted(db.iterdir()) if f.name[:1].isdigit()]


def snapshot(datadir: Path, files: list[str] | None = None) -> Residency:
    return {name: residency(datadir / name) for name in (files if files is not None else relation_files(datadir))}


def _resident(pages: bytes, i: int) -> bool:
    return i < len(pages) and pages[i] & 1 == 1


def only_in(held: Residency, other: Residency) -> Residency:
    """The pages `held` has resident and `other` has not (past the end of other's file too)."""
    return {name: bytes(1 if flag & 1 and not _resident(other.get(name, b""), i) else 0 for i, flag in enumerate(pages))
            for name, pages in held.items()}


def in_both(one: Residency, other: Residency) -> Residency:
    return {name: bytes(1 if flag & 1 and _resident(other.get(name, b""), i) else 0 for i, flag in enumerate(pages))
            for name, pages in one.items()}


def mb_by_relation(pages: Residency, name_of: Callable[[str], str]) -> dict[str, float]:
    """Resident MB per relation name, largest first; name_of maps "base/<db>/<file>"."""
    totals: Counter[str] = Counter()
    for path, flags in pages.items():
        if count := sum(flag & 1 for flag in flags):
            totals[name_of(path)] += count * PAGE / 2**20
    return {name: round(mb, 1) for name, mb in totals.most_common()}
