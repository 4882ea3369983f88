"""Canteen's C++ CPU kernels (canteen_ops.cpp, attention.cpp, dense.cpp, dense_float.cpp,
lowbit.cpp, stack.cpp, sampling.cpp, lora.cpp, share.cpp), built with the machine's own
compiler and loaded.

The ``torch.ops.canteen`` ops (``paged_decode_into``, ``rms_norm``, ``rotary``, ``silu_mul``,
``skinny_linear``, ``quant_linear``, ``decode_layers``, ``greedy_pick``, ``lora_add``) replace
many small ops of a decode step (worker/attention/paged.py, worker/model/forward.py,
worker/model/quant.py, worker/engine/sampler.py, worker/lora/slots.py). The library is compiled once
per source, flags, torch version and CPU (``-march=native``: a build for one machine's vector
units must not run on another's), into ``$CANTEEN_KERNEL_DIR`` or the environment's
``share/canteen-kernels``; ``make install`` builds it ahead (``python -m worker.kernels``), and
a worker that finds none builds it under a file lock, so concurrent workers build once. Without
a compiler, or with ``CANTEEN_KERNELS=0``, the worker keeps the pure-torch path and logs why.

A library is native code the worker runs, so the folder and the file must be owned by the
worker's user (or root), not writable by group or others, and not symlinks; anything else is
refused with the path and the rule, and the worker keeps the pure-torch path. The file is
opened once with ``O_NOFOLLOW``, checked on that descriptor, and loaded through it, so it
cannot be swapped between the check and the load. Builds write a unique temporary file in the
same folder and rename it into place.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import platform
import stat
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch.utils import cpp_extension

from canteen.logging import get_logger

log = get_logger(__name__)

HERE = Path(__file__).parent
# compiled together, one library
SOURCES = tuple(
    HERE / f
    for f in (
        "canteen_ops.cpp",
        "attention.cpp",
        "dense.cpp",
        "dense_float.cpp",
        "lowbit.cpp",
        "stack.cpp",
        "sampling.cpp",
        "lora.cpp",
        "share.cpp",
    )
)
HEADERS = (HERE / "common.h", HERE / "share.h")
# -ffp-contract=off: no fused multiply-adds, so a * b + c rounds as torch's two ops round it.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
BUILD_TIMEOUT_S = 600


def kernel_dir() -> Path:
    configured = os.environ.get("CANTEEN_KERNEL_DIR")
    return Path(configured) if configured else Path(sys.prefix) / "share" / "canteen-kernels"


def _cpu_signature() -> str:
    """The CPU model and feature flags: a build is only valid for the vector units it saw."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines() if ":" in line}
    return "\n".join(lines.get(key, "") for key in wanted)


def library_path() -> Path:
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    for text in (" ".join(FLAGS), torch.__version__, _cpu_signature()):
        digest.update(text.encode())
    return kernel_dir() / f"canteen_ops-{digest.hexdigest()[:16]}.so"


def _compile_command(out: Path, flags: tuple[str, ...] = FLAGS) -> list[str]:
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    return [
        os.environ.get("CXX", "g++"),
        *flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        *(str(p) for p in SOURCES),
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        *("-lc10", "-ltorch_cpu", "-ltorch"),
        "-o",
        str(out),
    ]


class UnsafeKernelError(RuntimeError):
    """A kernel folder or library that another user could have written; never loaded."""


def _check_owner_and_mode(info: os.stat_result, path: Path, what: str) -> None:
    euid = os.geteuid()
    if info.st_uid not in (euid, 0):
        raise UnsafeKernelError(
            f"kernel {what} {path} is owned by uid {info.st_uid}: it must be owned by the "
            f"worker's user (uid {euid}) or root"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeKernelError(
            f"kernel {what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: it must not be "
            "writable by group or others (at most 0755)"
        )


def check_folder(folder: Path) -> None:
    """Raises UnsafeKernelError unless ``folder`` is a real directory only its owner writes."""
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeKernelError(f"kernel folder {folder} must be a directory, not a symlink")
    _check_owner_and_mode(info, folder, "folder")


def open_library(path: Path) -> int:
    """A descriptor on ``path`` once it passes the checks; raises UnsafeKernelError."""
    check_folder(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeKernelError(f"kernel library {path} must not be a symlink") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeKernelError(f"kernel library {path} must be a regular file")
        _check_owner_and_mode(info, path, "library")
    except BaseException:
        os.close(fd)
        raise
    return fd


def build() -> Path:
    """Compiles the library if this machine has none yet; returns its path. Raises
    RuntimeError with the compiler's message when the build fails, UnsafeKernelError when the
    folder may be written by others."""
    path = library_path()
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    check_folder(path.parent)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path.parent / ".build.lock", flags, 0o600), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building the same library
        if os.path.lexists(path):
            return path
        fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        log.info("building CPU kernels", path=str(path))
        try:
            _compile(tmp)
            tmp.chmod(0o755)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _compile(out: Path) -> None:
    try:
        done = subprocess.run(
            _compile_command(out), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"compiler did not run: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"compiler failed: {done.stderr[-2000:]}")


@cache
def available() -> bool:
    """Whether the kernels are loaded (built first if needed). Never raises."""
    if os.environ.get("CANTEEN_KERNELS", "1") == "0":
        log.info("CPU kernels off", reason="CANTEEN_KERNELS=0")
        return False
    try:
        fd = open_library(build())
    except UnsafeKernelError as exc:
        log.warning("CPU kernels refused; using the pure-torch path", error=str(exc))
        return False
    except (RuntimeError, OSError) as exc:
        log.warning("CPU kernels unavailable; using the pure-torch path", error=str(exc)[-500:])
        return False
    try:  # load what was checked, through its descriptor: a swapped path changes nothing
        torch.ops.load_library(f"/proc/self/fd/{fd}")  # type: ignore[no-untyped-call]
    except (RuntimeError, OSError) as exc:
        log.warning("CPU kernels unavailable; using the pure-torch path", error=str(exc)[-500:])
        return False
    finally:
        os.close(fd)
    return True


@cache
def quant_vectorized() -> bool:
    """Whether ``quant_linear`` runs vectorized here (AVX512-BF16, or AVX2): without, it is a
    plain loop and torch's low-bit kernels are faster."""
    return available() and bool(torch.ops.canteen.quant_vectorized())
