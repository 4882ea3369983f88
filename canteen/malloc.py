"""Keeps the C allocator from giving memory back to the kernel in the middle of serving.

protobuf's Python extension (upb, ``python/protobuf.c``) frees its arenas through an
allocator that calls glibc's ``malloc_trim(0)`` after every 10,000 frees (upstream has since
disabled the call: "Find out whether this is still needed"). ``malloc_trim(0)`` walks every
heap of the process and hands each free page back to the kernel (``madvise(MADV_DONTNEED)``),
holding the GIL, since upb frees inside a Python dealloc; the next allocations fault those
pages in again. A worker frees a few dozen arenas per step (its plans and results), so this
came every few hundred steps, and after a long prompt's prefill had left hundreds of MiB free
in the heaps, one call ran 50-60 ms. `perf record` on the interference bench's worker (AMD
EPYC Zen 4 of README, Speed) caught its gRPC thread in that ``madvise`` at the same point of
every run: the next plan waited and the streams beside the long prompt saw a 65-86 ms gap
against their 15 ms median (``bench/kv.py --only interference``, the 4.9-5.7x rounds).

``silence_protobuf_trim`` points the extension's ``malloc_trim`` import (its PLT slot) at a
function that does nothing, so only upb's periodic call goes away; glibc still returns the
free top of a heap past its trim threshold as before. Every service calls it at start-up. It
finds the slot by the extension's relocation table and does nothing (and says so) where the
extension is not an ELF file with that import: another platform, a protobuf build without
the call.

``keep_freed_memory`` (the worker) also fixes glibc's trim and mmap thresholds, so the memory
a step frees stays in the process for the next step instead of being trimmed and faulted in
again: buffers under 32 MiB are reused, larger ones (a long prefill's attention scratch) are
mapped and unmapped as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
from pathlib import Path

from canteen.logging import get_logger

log = get_logger(__name__)

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30  # return a heap's free top to the kernel only past 1 GiB
MMAP_THRESHOLD = 32 << 20  # glibc's largest: buffers of 32 MiB and more get their own mapping

_SHT_RELA = 4
_JUMP_SLOTS = {62: 7, 183: 1026}  # e_machine -> R_*_JUMP_SLOT: x86-64, aarch64


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt  # noqa: B018 - glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Sets glibc's trim and mmap thresholds for this process; False where there is no glibc
    ``mallopt`` (the allocator keeps its defaults)."""
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done: bool = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and done
    log.info("malloc keeps freed memory", trim=TRIM_THRESHOLD, mmap=MMAP_THRESHOLD, applied=done)
    return done


def _import_slot(path: Path, symbol: str) -> int | None:
    """The offset (from the load base) of ``path``'s PLT slot for the imported ``symbol``."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return None
    machine = struct.unpack_from("<H", data, 18)[0]
    shoff, shentsize, shnum = (
        struct.unpack_from("<Q", data, 40)[0],
        *struct.unpack_from("<HH", data, 58),
    )
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_RELA or not entsize:
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for at in range(offset, offset + size, entsize):
            slot, info, _ = struct.unpack_from("<QQq", data, at)
            if info & 0xFFFFFFFF != _JUMP_SLOTS.get(machine):
                continue
            name_at = struct.unpack_from("<I", data, symtab[4] + (info >> 32) * symtab[9])[0]
            name = data[strtab[4] + name_at :].split(b"\0", 1)[0]
            if name == symbol.encode():
                return int(slot)
    return None


def _load_base(path: Path) -> int | None:
    """Where the dynamic loader mapped ``path`` in this process (its first mapping)."""
    real = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
            return int(fields[0].split("-")[0], 16)
    return None


def _writable(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line.split()[1].startswith("rw")
    return False


def silence_protobuf_trim() -> bool:
    """Points upb's ``malloc_trim`` import at a no-op; False (logged) where it cannot."""
    try:
        from google._upb import _message  # the extension, where this build has it
    except ImportError:
        return _unsilenced("protobuf has no upb extension")
    path = Path(_message.__file__ or "")
    try:
        offset, base = _import_slot(path, "malloc_trim"), _load_base(path)
    except (OSError, struct.error, IndexError):
        return _unsilenced("cannot read the extension's relocations")
    if offset is None or base is None:
        return _unsilenced("the extension imports no malloc_trim")
    slot, libc = base + offset, _libc()
    if not _writable(slot):  # bound at load and made read-only (full RELRO): leave it
        return _unsilenced("the extension's import table is read-only")
    if libc is None:
        return _unsilenced("no glibc")
    # upb calls malloc_trim(0) and ignores what it returns; libc's abs(0) does nothing and
    # returns 0. A C function, not a ctypes callback: it stays valid while the interpreter
    # shuts down, when upb frees its last arenas.
    ctypes.c_void_p.from_address(slot).value = ctypes.cast(libc.abs, ctypes.c_void_p).value
    log.info("protobuf's periodic malloc_trim silenced", extension=path.name)
    return True


def _unsilenced(why: str) -> bool:
    log.info("protobuf's periodic malloc_trim left as is", reason=why)
    return False
