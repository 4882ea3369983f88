"""canteen/local_socket.py's housekeeping: the folders a killed service left are removed at
the next start, and a live service's folder, a folder without its lock file, or anything
else under the same prefix is left alone."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from canteen.local_socket import LOCK_NAME, LocalServer, remove_stale


def _folder(parent: Path, name: str, with_lock: bool = True) -> Path:
    folder = parent / name
    folder.mkdir(mode=0o700)
    if with_lock:
        (folder / LOCK_NAME).write_bytes(b"")
    return folder


def test_a_dead_owners_folder_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    dead = _folder(tmp_path, "canteen-test-dead")
    live = _folder(tmp_path, "canteen-test-live")
    bare = _folder(tmp_path, "canteen-test-bare", with_lock=False)
    other = _folder(tmp_path, "other-dead")
    with open(live / LOCK_NAME, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running server holds it
        assert remove_stale(tmp_path, "canteen-test-") == [dead]
    assert not dead.exists()
    assert live.exists() and bare.exists() and other.exists()


async def test_a_server_clears_stale_folders_and_holds_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _folder(tmp_path, "canteen-test-dead")

    async def serve(payloads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for payload in payloads:
            yield payload

    server = LocalServer("canteen-test-", "test", serve)
    path = Path(await server.start())
    assert not dead.exists()
    assert path.exists() and (path.parent / LOCK_NAME).exists()
    assert remove_stale(tmp_path, "canteen-test-") == []  # its own lock is held
    server.close()
    assert not path.parent.exists()
