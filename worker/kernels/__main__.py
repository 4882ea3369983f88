"""``python -m worker.kernels``: builds this machine's CPU kernels now (make install does)."""

from worker.kernels import build

if __name__ == "__main__":
    print(build())
