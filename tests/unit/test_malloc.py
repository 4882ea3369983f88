"""canteen/malloc.py: no service stalls while the C allocator gives memory back to the kernel.
protobuf's periodic ``malloc_trim`` goes to a no-op, and a worker keeps the memory a step
freed, so the next step's buffers reuse it without faulting its pages in again."""

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


# In a fresh process: silence upb's periodic malloc_trim, then build and drop 25,000 protobuf
# messages (an arena each). upb calls its trim after every 10,000 frees: those calls must land
# in Canteen's no-op, not in glibc.
SILENCE = textwrap.dedent(
    """
    import json
    from canteen import malloc
    from canteen.v1 import worker_pb2
    silenced = malloc.silence_protobuf_trim()
    for i in range(25_000):
        worker_pb2.StepPlan(step_id=i).SerializeToString()
    print(json.dumps({"silenced": silenced, "no_op_calls": malloc.num_silenced_trims}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an ELF extension")
def test_protobufs_periodic_trim_lands_in_the_no_op() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SILENCE], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"silenced": True, "no_op_calls": 2}


def test_an_import_slot_is_found_only_where_it_is(tmp_path: Path) -> None:
    from google._upb import _message

    extension = Path(_message.__file__ or "")
    assert _import_slot(extension, "malloc_trim") is not None
    assert _import_slot(extension, "no_such_function") is None
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"not an ELF file at all, just text" * 4)
    assert _import_slot(not_elf, "malloc_trim") is None
