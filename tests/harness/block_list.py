"""A minimal encoder of pg_ccm's block list format (v1), for crafting test inputs.

The real codec is codec/src/block_list.rs; this writes the same bytes for the simple
case the tests need: blocks of a few relation forks, each group's blocks as runs.
"""

from __future__ import annotations

import struct
from itertools import groupby

MAGIC = b"CCMB"
VERSION = 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def encode(blocks: list[tuple[int, int, int, int, int, int]], version: int = VERSION) -> bytes:
    """blocks: (spc, db, rel, fork, block, usage) tuples."""
    ordered = sorted(set(blocks))
    body = bytearray()
    groups = 0
    for (spc, db, rel, fork), members in groupby(ordered, key=lambda b: b[:4]):
        members = list(members)
        numbers = [m[4] for m in members]
        usages = [m[5] for m in members]
        runs = _runs(numbers)
        body += struct.pack("<IIIB", spc, db, rel, fork) + _varint(len(runs))
        previous_end = None
        for start, length in runs:
            gap = start if previous_end is None else start - previous_end - 1
            body += _varint(gap) + _varint(length - 1)
            previous_end = start + length - 1
        for i in range(0, len(usages), 2):
            low = usages[i]
            high = usages[i + 1] if i + 1 < len(usages) else 0
            body.append(low | (high << 4))
        groups += 1
    header = MAGIC + struct.pack("<BBHIIQQ", version, 0, 0, groups, len(ordered), 0, 0)
    return bytes(header) + bytes(body)
