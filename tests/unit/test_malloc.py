"""canteen/malloc.py: no service stalls while the C allocator gives memory back to the kernel.
protobuf's periodic ``malloc_trim`` does nothing, and a worker keeps the memory a step freed,
so the next step's buffers reuse it without faulting its pages in again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from canteen.malloc import _import_slot

# In a fresh process, a thread (its own glibc arena, like the worker's gRPC thread) runs six
# "steps": each allocates 16 buffers of 1 MiB, writes them, frees them. Prints the thread's
# minor page faults per step.
PROBE = textwrap.dedent(
    """
    import ctypes, json, resource, sys, threading
    from canteen.malloc import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 1 << 20, []
    def steps():
        for _ in range(6):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            buffers = [libc.malloc(size) for _ in range(16)]
            for b in buffers:
                ctypes.memset(b, 1, size)
            for b in reversed(buffers):
                libc.free(b)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    print(json.dumps(faults))
    """
)
PAGES = 16 * (1 << 20) // 4096  # what one step writes, in 4 KiB pages


def _faults(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_step_reuses_what_the_last_step_freed() -> None:
    kept = _faults("keep")
    assert kept[0] >= PAGES // 2, kept  # the first step faults its pages in
    assert max(kept[1:]) <= PAGES // 100, kept  # the later ones reuse them
    # the control: with glibc's defaults every step faults most of its pages in again
    default = _faults("default")
    assert min(default[1:]) >= PAGES // 2, default


# In a fresh process that keeps freed memory (so glibc itself trims nothing): free 32 MiB of
# written buffers, then build and drop 25,000 protobuf messages (an arena each; upb calls
# malloc_trim(0) after every 10,000 frees). Prints the resident MiB before and after the
# messages: a real malloc_trim hands the freed 32 MiB back to the kernel.
SILENCE = textwrap.dedent(
    """
    import ctypes, json, sys
    from canteen import malloc
    from canteen.v1 import worker_pb2
    assert malloc.keep_freed_memory()
    silenced = malloc.silence_protobuf_trim() if sys.argv[1] == "silence" else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    buffers = [libc.malloc(1 << 20) for _ in range(32)]
    for b in buffers:
        ctypes.memset(b, 1, 1 << 20)
    for b in reversed(buffers):
        libc.free(b)
    before = rss_mib()
    for i in range(25_000):
        worker_pb2.StepPlan(step_id=i).SerializeToString()
    print(json.dumps({"silenced": silenced, "before": before, "after": rss_mib()}))
    """
)


def _rss_around_messages(mode: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", SILENCE, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an ELF extension, glibc")
def test_protobuf_no_longer_trims_the_heap() -> None:
    silenced = _rss_around_messages("silence")
    assert silenced["silenced"] is True
    assert silenced["after"] >= silenced["before"] - 4, silenced  # the freed 32 MiB stayed
    # the control: upb's own malloc_trim gives the freed 32 MiB back to the kernel
    trimmed = _rss_around_messages("as-shipped")
    assert trimmed["after"] <= trimmed["before"] - 24, trimmed


def test_an_import_slot_is_found_only_where_it_is(tmp_path: Path) -> None:
    from google._upb import _message

    extension = Path(_message.__file__ or "")
    assert _import_slot(extension, "malloc_trim") is not None
    assert _import_slot(extension, "no_such_function") is None
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"not an ELF file at all, just text" * 4)
    assert _import_slot(not_elf, "malloc_trim") is None
