"""A throwaway certificate authority and one certificate per role, for mutual TLS.

``canteen up`` makes them in its data folder at start; ``canteen certs DIR`` (or
``python -m canteen.certs DIR``) makes them anywhere, e.g. in compose's ``certs`` volume::

    DIR/ca.pem  DIR/ca.key                  the CA (its key never leaves DIR)
    DIR/<role>.pem  DIR/<role>.key          registry, scheduler, worker, gateway, client

A certificate's subject common name is its role, which the servers check on every RPC
(canteen/tls.py). Each also names its role as a DNS subject alternative name: clients verify
the server they dial by that name (``ssl_target_name_override``), so a worker's certificate is
valid at whatever address it advertises. ``--hosts`` adds further names and IPs.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("registry", "scheduler", "worker", "gateway", "client")
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
_VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "canteen"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(names: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
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


def make_ca(
    folder: Path, name: str = "canteen suite CA"
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(name), _name(name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    _write_cert(folder / "ca.pem", cert)
    _write_key(folder / "ca.key", key)
    return cert, key


def issue(
    folder: Path,
    role: str,
    hosts: Sequence[str],
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
) -> None:
    """Writes ``role.pem`` and ``role.key``: common name ``role``, valid for client and
    server use, for ``role`` plus ``hosts`` as subject alternative names."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(role), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san([role, *hosts]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_cert(folder / f"{role}.pem", cert)
    _write_key(folder / f"{role}.key", key)


def make_suite_certs(
    folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS, roles: Sequence[str] = ROLES
) -> None:
    """A fresh CA and one certificate per role in ``folder``."""
    ca = make_ca(folder)
    for role in roles:
        issue(folder, role, hosts, ca)


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
        "--keep", action="store_true", help="do nothing when FOLDER/ca.pem already exists"
    )
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if args.keep and (folder / "ca.pem").exists():
        print(f"certificates already in {folder}; kept")
        return
    make_suite_certs(folder, [h.strip() for h in args.hosts.split(",") if h.strip()])
    print(f"wrote a CA and certificates for {', '.join(ROLES)} to {folder}")


if __name__ == "__main__":
    main()
