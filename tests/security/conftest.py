"""A suite on mutual TLS with API keys and admin keys, for the attacks in this folder.

registry, scheduler, one tiny worker, and two gateways on the same scheduler: one with a
shared prefix cache, one with ``--cache-isolation key``. Every internal link presents its
role's certificate from a CA made here; a second, unrelated CA makes the impostors' certs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from canteen.certs import make_suite_certs
from canteen.tls import Tls
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, free_port, wait_serving

# Tenants' API keys; sk-ops may ask for priority up to 5, the others for 0.
KEY_A, KEY_B, KEY_OPS = "sk-tenant-a", "sk-tenant-b", "sk-ops"
GATEWAY_ADMIN_KEY = "gw-admin-key"
GATEWAY_ADMIN_FILE = "gateway-admin.txt"
BLOCK_SIZE = 8


@dataclass
class SecureSuite:
    suite: Suite
    registry: Service
    scheduler: Service
    worker: Service
    shared: Service  # gateway, shared prefix cache
    isolated: Service  # gateway, --cache-isolation key
    certs: Path
    foreign: Path  # certificates of an unrelated CA
    model_root: Path
    model_dir: Path

    def tls(self, role: str, worker_id: str = "worker") -> Tls:
        """``role``'s certificate of the suite's CA (a worker's: ``worker_id``'s)."""
        return Tls.from_folder(self.certs, role, worker_id if role == "worker" else "")

    def foreign_tls(self, role: str) -> Tls:
        return Tls.from_folder(self.foreign, role, "worker" if role == "worker" else "")

    def start_public_tls_gateway(self, name: str) -> Service:
        """A gateway whose public ports serve TLS with the gateway's certificate."""
        return self.suite.start_gateway(
            self.registry,
            self.scheduler,
            "--api-keys-file",
            str(self.suite.workdir / "keys.txt"),
            "--public-tls-cert",
            str(self.certs / "gateway.pem"),
            "--public-tls-key",
            str(self.certs / "gateway.key"),
            "--health-port",
            str(free_port()),
            name=name,
        )


@pytest.fixture(scope="session")
def secure(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureSuite]:
    work = tmp_path_factory.mktemp("secure")
    certs, foreign = work / "certs", work / "foreign"
    make_suite_certs(certs)
    make_suite_certs(foreign)
    model_root = tiny_model_dir  # AddModel may register from here only
    keys = work / "keys.txt"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n{KEY_OPS} priority=5\n")
    admin = work / GATEWAY_ADMIN_FILE
    admin.write_text(f"{GATEWAY_ADMIN_KEY} scope=read\n")  # the gateway holds no write key
    s = Suite(work, certs=certs, model_root=model_root)
    try:
        # The registry knows the gateway's key as a read key: writes with it are refused.
        registry = s.start_tiny_registry(tiny_model_dir, read_keys=(GATEWAY_ADMIN_KEY,))
        scheduler = s.start_scheduler(registry)
        worker = s.start_worker(
            registry,
            "tiny",
            "--num-kv-blocks",
            "128",
            "--block-size",
            str(BLOCK_SIZE),
            *TRANSFORMERS_DTYPE,
            "--threads",
            "1",
            "--max-batched-tokens",
            "256",
        )
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60, tls=s.tls(), role="scheduler")
        gateway_args = ["--api-keys-file", str(keys), "--admin-keys-file", str(admin)]
        shared = s.start_gateway(registry, scheduler, *gateway_args, name="gateway-shared")
        isolated = s.start_gateway(
            registry,
            scheduler,
            *gateway_args,
            "--cache-isolation",
            "key",
            name="gateway-isolated",
        )
        yield SecureSuite(
            s,
            registry,
            scheduler,
            worker,
            shared,
            isolated,
            certs,
            foreign,
            model_root,
            tiny_model_dir,
        )
    finally:
        codes = s.stop()
    assert set(codes.values()) == {0}, codes
