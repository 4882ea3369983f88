"""The disk tier: one file per block in --kv-disk-dir, least recently used out first.

    <key hex>.kv = header | payload
    header       = magic "CNTKVBLK", format, model version digest (32 bytes), key (16),
                   content key (16), payload length, crc32 of key + content key + payload

A block is written under a temporary name in the same folder and renamed into place
(``os.replace`` is atomic), so a reader, this worker or another one sharing the folder,
sees a whole block or none. A file whose header or checksum does not match is deleted and
reported missing: the scheduler then has the prefix recomputed, it is never served. Blocks
survive a restart; only a worker of the same model version digest reuses them. Disk full
or any I/O error drops the block with a warning: a miss, never a failed request.

The index is locked: a background writer (worker/kv_tiers/writer.py) puts blocks while the
step's thread gets them. File reads and writes run outside the lock.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

from canteen.logging import get_logger
from worker.kv_tiers.host import TierBlock

log = get_logger(__name__)

MAGIC = b"CNTKVBLK"
FORMAT = 1
_HEADER = struct.Struct("<8sH32s16s16sQI")
SUFFIX = ".kv"
_FOREIGN = TierBlock(b"", b"")  # a whole block of another model version or format


def _crc(key: bytes, content_key: bytes, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key + content_key))


class DiskTier:
    """Blocks of one model version in ``folder``, this worker's share bounded by
    ``capacity_bytes``."""

    def __init__(self, folder: Path, capacity_bytes: int, version_digest: bytes) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"kv_disk_bytes={capacity_bytes}: must be >= 0")
        if len(version_digest) != 32:
            raise ValueError("version_digest: must be 32 bytes")
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.version_digest = version_digest
        self.num_bytes = 0
        self.num_errors = 0
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._lock = threading.Lock()  # guards _files, num_bytes and num_errors
        folder.mkdir(parents=True, exist_ok=True)
        self._scan()

    def __len__(self) -> int:
        return len(self._files)

    def keys(self) -> list[bytes]:
        """Keys of the blocks this worker knows on disk, least recent first."""
        with self._lock:
            return list(self._files)

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{SUFFIX}"

    def put(self, key: bytes, block: TierBlock) -> list[bytes]:
        """Writes ``block``; returns the keys no longer on disk because of it (evicted ones,
        or ``key`` itself when it could not be written)."""
        size = _HEADER.size + len(block.payload)
        if size > self.capacity_bytes:
            return [key]
        with self._lock:
            dropped = self._make_room(key, size)
        if not self._write(key, block):
            return [*dropped, key]
        with self._lock:
            self._forget(key)
            self._files[key] = size
            self.num_bytes += size
            while self.num_bytes > self.capacity_bytes and len(self._files) > 1:
                dropped.append(self._evict_oldest())  # room others took meanwhile
        return dropped

    def _make_room(self, key: bytes, size: int) -> list[bytes]:
        self._forget(key)
        dropped = []
        while self._files and self.num_bytes + size > self.capacity_bytes:
            dropped.append(self._evict_oldest())
        return dropped

    def _evict_oldest(self) -> bytes:
        old, old_size = self._files.popitem(last=False)
        self.num_bytes -= old_size
        self._unlink(old)
        return old

    def _write(self, key: bytes, block: TierBlock) -> bool:
        """The file, whole or not at all: written under a temporary name, then renamed."""
        header = _HEADER.pack(
            MAGIC,
            FORMAT,
            self.version_digest,
            key,
            block.content_key,
            len(block.payload),
            _crc(key, block.content_key, block.payload),
        )
        target = self.path(key)
        temp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(temp, "wb") as out:
                out.write(header)
                out.write(block.payload)
            os.replace(temp, target)
        except OSError as exc:
            self._warn("write", key, exc)
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass  # the folder itself is gone or unusable
            return False
        return True

    def read(self, key: bytes) -> bytes | OSError:
        """The raw file of ``key``, or the error reading it (no index change: any thread)."""
        try:
            return self.path(key).read_bytes()
        except OSError as exc:
            return exc

    def get(self, key: bytes) -> TierBlock | None:
        """The block under ``key`` when its file is whole, of this model version and matches
        its checksum; a bad file is deleted. Files other workers wrote to a shared folder are
        found too."""
        return self.accept(key, self.read(key))

    def accept(self, key: bytes, data: bytes | OSError) -> TierBlock | None:
        """``get`` on bytes ``read`` returned (maybe read ahead, on another thread)."""
        path = self.path(key)
        if isinstance(data, OSError):
            if not isinstance(data, FileNotFoundError):
                self._warn("read", key, data)
            with self._lock:
                self._forget(key)
            return None
        block = self._parse(key, data)
        if block is _FOREIGN:
            with self._lock:
                self._forget(key)
            return None  # another model version's block: its workers still use it
        if block is None:
            log.warning("kv disk block refused", key=key.hex(), reason="bad header or checksum")
            with self._lock:
                self.num_errors += 1
                self._forget(key)
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            return None
        with self._lock:
            if key not in self._files:
                self._files[key] = len(data)
                self.num_bytes += len(data)
            self._files.move_to_end(key)
        try:
            os.utime(path)  # recency survives a restart and is seen by other workers
        except OSError:
            pass
        return block

    def _parse(self, key: bytes, data: bytes) -> TierBlock | None:
        """The block, ``_FOREIGN`` for another version's or format's, None when damaged."""
        if len(data) < _HEADER.size:
            return None
        magic, fmt, version, stored_key, content_key, length, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic == MAGIC and (fmt, version) != (FORMAT, self.version_digest):
            return _FOREIGN
        if (magic, stored_key) != (MAGIC, key):
            return None
        if length != len(payload) or crc != _crc(key, content_key, payload):
            return None
        return TierBlock(content_key, payload)

    def _scan(self) -> None:
        """Indexes the files of this model version already in the folder, oldest first."""
        found = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                key = bytes.fromhex(path.name.removesuffix(SUFFIX))
                with open(path, "rb") as f:
                    head = f.read(_HEADER.size)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if len(head) < _HEADER.size:
                continue
            magic, fmt, version, stored_key, _, length, _ = _HEADER.unpack(head)
            if (magic, fmt, version, stored_key) != (MAGIC, FORMAT, self.version_digest, key):
                continue  # another model version's block, or not a block
            if stat.st_size == _HEADER.size + length:
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self.num_bytes += size

    def _forget(self, key: bytes) -> None:
        size = self._files.pop(key, None)
        if size is not None:
            self.num_bytes -= size

    def _unlink(self, key: bytes) -> None:
        try:
            self.path(key).unlink()
        except OSError:
            pass  # gone already (another worker sharing the folder evicted it)

    def _warn(self, what: str, key: bytes, exc: OSError) -> None:
        with self._lock:
            self.num_errors += 1
        log.warning(
            "kv disk tier error: the block is recomputed when needed",
            op=what,
            key=key.hex(),
            error=str(exc),
        )
