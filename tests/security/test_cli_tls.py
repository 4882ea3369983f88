"""The ``canteen`` CLI never falls back to plaintext: TLS when it has certificates, plaintext
only with ``--insecure`` (said on stderr), a refusal naming ``--insecure`` otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.security.conftest import KEY_A, SecureSuite
from tests.support.suite import ADMIN_KEY, ROOT


def _canteen(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with no certificates to find: no CANTEEN_TLS_*, an empty data folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CANTEEN_")}
    env["CANTEEN_DATA_DIR"] = str(tmp_path / "data")
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "canteen.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_models_refuse_plaintext_without_insecure(secure: SecureSuite, tmp_path: Path) -> None:
    registry = secure.registry.address
    for command in (
        ["list"],
        ["add", str(secure.model_dir), "--name", "tiny", "--version", "v7"],
        ["delete", "tiny:v1"],
        ["alias", "tiny", "--to", "v1=1"],
    ):
        done = _canteen(
            tmp_path, "models", "--registry", registry, "--admin-key", ADMIN_KEY, *command
        )
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr == (
            f"canteen models: error: no client certificate for the registry at {registry}: "
            "pass --tls-cert, --tls-key and --tls-ca (CANTEEN_TLS_*), or run `canteen up`, "
            f"whose certificates are read from {tmp_path / 'data' / 'certs'}, or pass "
            "--insecure for plaintext\n"
        ), command
        assert done.stdout == ""
    # With the client certificate it talks TLS; nothing was written above.
    certs = secure.certs
    tls = ["--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]
    listed = _canteen(
        tmp_path, "models", "--registry", registry, *tls, "--tls-ca", str(certs / "ca.pem"), "list"
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].startswith("* tiny:v1  max_model_len=")
    assert len(listed.stdout.splitlines()) == 1


def test_insecure_is_said_and_a_tls_registry_does_not_answer_it(
    secure: SecureSuite, tmp_path: Path
) -> None:
    registry = secure.registry.address
    done = _canteen(tmp_path, "models", "--registry", registry, "--insecure", "list")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == (
        f"warning: --insecure: plaintext to the registry at {registry}; the admin key and the "
        "model records travel in clear"
    )
    assert lines[-1].startswith("error: UNAVAILABLE: ")


def test_generate_refuses_plaintext_and_talks_tls_with_ca(
    secure: SecureSuite, tmp_path: Path
) -> None:
    certs = secure.certs
    gateway = secure.start_public_tls_gateway("gateway-cli-tls")
    ask = ["generate", "over TLS", "--max-tokens", "3", "--temperature", "0", "--ignore-eos"]
    ask += ["--address", gateway.address, "--api-key", KEY_A]
    refused = _canteen(tmp_path, *ask)
    assert refused.returncode == 2
    assert refused.stderr == (
        f"canteen generate: error: no TLS settings for the gateway at {gateway.address}: pass "
        "--ca FILE (the CA of its public certificate; CANTEEN_GATEWAY_CA), --tls (a "
        "certificate from a CA this system trusts), or --insecure for plaintext\n"
    )
    done = _canteen(tmp_path, *ask, "--ca", str(certs / "ca.pem"))
    assert done.returncode == 0, done.stderr
    assert "finish=length prompt_tokens=" in done.stderr
    assert "completion_tokens=3 " in done.stderr
    plain = _canteen(tmp_path, *ask, "--insecure")
    assert plain.returncode == 1
    assert plain.stderr.splitlines()[0] == (
        f"warning: --insecure: plaintext to the gateway at {gateway.address}; the prompt, the "
        "answer and the API key travel in clear"
    )
    assert plain.stderr.splitlines()[-1].startswith("error: UNAVAILABLE: ")
    assert gateway.terminate() == 0
