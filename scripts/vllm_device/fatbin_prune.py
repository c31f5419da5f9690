"""Blank the GPU code in a shared library that a GPU of one compute capability can never load.

A CUDA library carries its kernels as fat binaries: containers (magic 0xBA55ED50) of entries,
each a cubin (machine code for one architecture) or PTX (portable code the driver compiles at
load). For a device of compute capability 9.0 the driver takes, per container, a cubin built for
arch 90, else the PTX of the highest arch <= 90. Every other entry is dead weight there.

`prune(data, arch)` keeps exactly what the driver could pick, as `nvprune` does for object
files: each container is rewritten in place to hold only those entries, and the bytes it no
longer needs become zeros. The file's size, its sections and every symbol stay where they were
(a container is found through a pointer to its start), and runs of zeros compress to almost
nothing. vLLM's wheel
builds its kernels for sm_75 ... sm_120; on the H200 only the sm_90 part is ever read.

    python scripts/vllm_device/fatbin_prune.py LIB.so [--arch 90] [--dry-run]
"""
from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass

MAGIC = struct.pack("<I", 0xBA55ED50)
HEADER = struct.Struct("<IHHQ")          # magic, version, header size, size of the entries
ENTRY = struct.Struct("<HHIQ")           # kind, unknown, entry header size, payload size
ARCH_OFFSET = 28                         # uint32 architecture (75, 80, 90, 100, ...) in an entry
PTX, CUBIN = 1, 2


@dataclass(frozen=True)
class Entry:
    kind: int            # PTX or CUBIN
    arch: int
    start: int           # of the entry's header, in the file
    offset: int          # of the payload, in the file
    size: int            # payload bytes


def containers(data: bytes):
    """(start, header size, Entries) of each well-formed fat-binary container in `data`."""
    i = data.find(MAGIC)
    while i >= 0:
        _, version, header_size, fat_size = HEADER.unpack_from(data, i)
        end = i + header_size + fat_size
        entries, p = [], i + header_size
        while version == 1 and header_size == 16 and p + ENTRY.size <= end:
            kind, _, entry_size, size = ENTRY.unpack_from(data, p)
            if kind not in (PTX, CUBIN) or entry_size < 48 or p + entry_size + size > end:
                break
            arch = struct.unpack_from("<I", data, p + ARCH_OFFSET)[0]
            entries.append(Entry(kind, arch, p, p + entry_size, size))
            p += entry_size + size
        if entries and p == end:
            yield i, header_size, entries
            i = data.find(MAGIC, end)
        else:
            i = data.find(MAGIC, i + 4)


def loadable(entries: list, arch: int) -> set:
    """Indices of the entries the driver could load on a device of `arch` (cubins of that arch;
    failing those, the PTX of the highest arch not above it)."""
    cubins = {k for k, e in enumerate(entries) if e.kind == CUBIN and e.arch == arch}
    if cubins:
        return cubins
    ptx = [(e.arch, k) for k, e in enumerate(entries) if e.kind == PTX and e.arch <= arch]
    if not ptx:
        return set()
    best = max(a for a, _ in ptx)
    return {k for a, k in ptx if a == best}


def prune(data: bytes, arch: int = 90) -> tuple[bytearray, dict]:
    """(`data` with each container holding only the entries the device can load, counts).

    The kept entries move to the front of their container and its size shrinks to them; the
    bytes after them, up to the container's old end, become zeros. A container with nothing
    loadable keeps its smallest entry, so that no container is empty.
    """
    out = bytearray(data)
    stats = {"containers": 0, "entries": 0, "kept": 0, "kept_bytes": 0, "freed_bytes": 0,
             "containers_without_code": 0}
    for start, header_size, entries in containers(data):
        keep = loadable(entries, arch)
        stats["containers"] += 1
        stats["entries"] += len(entries)
        if not keep:
            stats["containers_without_code"] += 1
            keep = {min(range(len(entries)), key=lambda k: entries[k].size)}
        end = entries[-1].offset + entries[-1].size
        body = b"".join(data[e.start:e.offset + e.size]
                        for k, e in enumerate(entries) if k in keep)
        p = start + header_size
        out[p:p + len(body)] = body
        out[p + len(body):end] = bytes(end - p - len(body))
        struct.pack_into("<Q", out, start + 8, len(body))
        stats["kept"] += len(keep)
        stats["kept_bytes"] += len(body)
        stats["freed_bytes"] += end - p - len(body)
    return out, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs="+")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    for lib in args.libs:
        with open(lib, "rb") as f:
            data = f.read()
        out, stats = prune(data, args.arch)
        print(f"{lib}: {stats}", file=sys.stderr)
        if not args.dry_run:
            with open(lib, "wb") as f:
                f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
