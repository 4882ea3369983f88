"""A throwaway certificate authority and one certificate per role, for mutual TLS.

``canteen certs DIR`` (or ``python -m canteen.certs DIR``) makes them anywhere, e.g. in
compose's ``certs`` volume; ``canteen up`` makes them in its data folder with the CA's key in
memory only::

    DIR/ca.pem  DIR/ca.key                  the CA (``canteen certs`` only; 0600)
    DIR/<role>.pem  DIR/<role>.key          registry, scheduler, gateway, client
    DIR/worker/<id>.pem  DIR/worker/<id>.key  one per worker (``--workers``)

A certificate's role is one URI subject alternative name, ``spiffe://canteen/<role>``, or
``spiffe://canteen/worker/<id>`` for a worker: one certificate is one worker. The servers read
it on every RPC (canteen/tls.py); the common name is only a label. The role is also a DNS name
(and a worker's ``<id>.worker.canteen``): clients verify the server they dial by that name
(``ssl_target_name_override``), so a worker's certificate is valid at whatever address it
advertises. ``--hosts`` adds further names and IPs, except other roles' names: only the
registry's certificate may say it is ``registry``. Keys are written 0600 with
``O_EXCL|O_NOFOLLOW``: never over an existing file, never through a symlink.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("registry", "scheduler", "worker", "gateway", "client")
SERVICE_ROLES = ("registry", "scheduler", "gateway", "client")  # one certificate each
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_WORKERS = ("worker",)
URI_PREFIX = "spiffe://canteen/"
# A worker id that fits in a URI path segment and a DNS label chain as it is.
WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_VALID_DAYS = 365

Ca = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def role_uri(role: str, worker_id: str = "") -> str:
    """The URI SAN that names ``role`` (a worker: with its id)."""
    return f"{URI_PREFIX}worker/{worker_id}" if role == "worker" else f"{URI_PREFIX}{role}"


WORKER_DNS_SUFFIX = ".worker.canteen"


def worker_dns_name(worker_id: str) -> str:
    """The DNS name a worker's certificate carries for its id; the scheduler dials by it."""
    return f"{worker_id}{WORKER_DNS_SUFFIX}"


def check_worker_id(worker_id: str) -> str:
    if not WORKER_ID.fullmatch(worker_id):
        raise ValueError(
            f"worker_id={worker_id!r}: 1 to 63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return worker_id


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "canteen"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Creates ``path`` with ``data``; refuses an existing file or a symlink at it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        raise FileExistsError(
            f"{path}: already exists; certificates are never overwritten"
        ) from None
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_new(path, data, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    _write_new(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _san(names: Iterable[str], uri: str) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)]
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
    )


def new_ca(name: str = "canteen suite CA") -> Ca:
    """A CA certificate and its key, in memory."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        _builder(_name(name), _name(name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_ca(folder: Path, name: str = "canteen suite CA", keep_key: bool = True) -> Ca:
    """A new CA: ``ca.pem`` in ``folder``, and ``ca.key`` (0600) only when ``keep_key``."""
    ca = new_ca(name)
    folder.mkdir(parents=True, exist_ok=True)
    _write_cert(folder / "ca.pem", ca[0])
    if keep_key:
        _write_key(folder / "ca.key", ca[1])
    return ca


def load_ca(folder: Path) -> Ca:
    """The CA that ``canteen certs`` left in ``folder`` (to add a worker later)."""
    cert = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{folder / 'ca.key'}: not an EC key")
    return cert, key


def build_cert(
    role: str, hosts: Sequence[str], ca: Ca, worker_id: str = ""
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``role`` (a worker: for ``worker_id``) and its new key."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {', '.join(ROLES)}")
    # A certificate never carries another role's name, nor a worker-id name: clients check
    # a server by those (``ssl_target_name_override``), so only that role may hold them.
    others = [h for h in hosts if h not in ROLES and not h.endswith(WORKER_DNS_SUFFIX)]
    dns = [role, *others]
    if role == "worker":
        dns.insert(1, worker_dns_name(check_worker_id(worker_id)))
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    cert = (
        _builder(_name(role), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(dns, role_uri(role, worker_id)), critical=False)
        .add_extension(usage, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def cert_path(folder: Path, role: str, worker_id: str = "") -> Path:
    """Where ``role``'s certificate lies in a folder made here (its key: ``.key``)."""
    return folder / "worker" / f"{worker_id}.pem" if role == "worker" else folder / f"{role}.pem"


def issue(folder: Path, role: str, hosts: Sequence[str], ca: Ca, worker_id: str = "") -> Path:
    """Writes ``role``'s certificate and key (a worker's under ``worker/``); the .pem path."""
    cert, key = build_cert(role, hosts, ca, worker_id)
    path = cert_path(folder, role, worker_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_cert(path, cert)
    _write_key(path.with_suffix(".key"), key)
    return path


def make_suite_certs(
    folder: Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    roles: Sequence[str] = SERVICE_ROLES,
    workers: Sequence[str] = DEFAULT_WORKERS,
    keep_ca_key: bool = True,
) -> None:
    """A fresh CA and one certificate per role and per worker in ``folder``. Without
    ``keep_ca_key`` the CA's key never touches the disk and is dropped on return."""
    ca = make_ca(folder, keep_key=keep_ca_key)
    for role in roles:
        if role != "worker":
            issue(folder, role, hosts, ca)
    for worker_id in workers:
        issue(folder, "worker", hosts, ca, worker_id)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="canteen certs", description="Make a throwaway CA and per-role certificates"
    )
    parser.add_argument("folder", help="where to write ca.pem, ca.key, ROLE.pem, ROLE.key")
    parser.add_argument(
        "--hosts",
        default=",".join(DEFAULT_HOSTS),
        help="extra DNS names and IPs for every certificate, comma-separated",
    )
    parser.add_argument(
        "--workers",
        default=",".join(DEFAULT_WORKERS),
        help="worker ids, comma-separated: one certificate each, worker/ID.pem",
    )
    parser.add_argument(
        "--add-workers",
        action="store_true",
        help="only issue --workers with the CA already in FOLDER (ca.pem, ca.key)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="do nothing when FOLDER/ca.pem already exists"
    )
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    hosts, workers = _split(args.hosts), _split(args.workers)
    try:
        for worker_id in workers:
            check_worker_id(worker_id)
        if args.add_workers:
            ca = load_ca(folder)
            for worker_id in workers:
                issue(folder, "worker", hosts, ca, worker_id)
            print(f"wrote certificates for workers {', '.join(workers)} to {folder}/worker")
            return
        if args.keep and (folder / "ca.pem").exists():
            print(f"certificates already in {folder}; kept")
            return
        make_suite_certs(folder, hosts, workers=workers)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"canteen certs: error: {exc}\n")
    print(
        f"wrote a CA and certificates for {', '.join(SERVICE_ROLES)} and workers "
        f"{', '.join(workers)} to {folder}"
    )


if __name__ == "__main__":
    main()
