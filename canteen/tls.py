"""Mutual TLS between the suite's services, and the caller's role on every RPC.

Every internal link (gateway -> scheduler, scheduler -> worker, every service -> registry)
runs on TLS with client certificates from the suite's CA (canteen/certs.py). A server
refuses, in the handshake, any client whose certificate the CA did not sign; each RPC then
checks the caller's role (``Policy``): the certificate's one URI subject alternative name,
``spiffe://canteen/<role>`` or ``spiffe://canteen/worker/<id>``. The common name counts for
nothing, and a certificate with no role URI, or more than one, is refused on every method. A
client checks the server it dials by the DNS name of the role it expects
(``ssl_target_name_override``; a worker by its id's name), so a worker's certificate is valid
at whatever address it advertises.

Plaintext is a choice the operator makes on purpose: ``--insecure``, logged at start.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from canteen.certs import ROLES, URI_PREFIX, WORKER_ID, cert_path, worker_dns_name
from canteen.config import option
from canteen.logging import get_logger

TLS_CERT_HELP = "this service's certificate (PEM), signed by the suite's CA"
TLS_KEY_HELP = "the certificate's private key (PEM)"
TLS_CA_HELP = "the suite's CA certificate (PEM): peers must present certificates it signed"
INSECURE_HELP = (
    "run internal links in plaintext, without certificates or roles (not for production)"
)
HEALTH_PORT_HELP = (
    "a second, plaintext port serving only grpc.health.v1, for probes that cannot present a "
    "client certificate (-1: off)"
)


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}={path!r}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Tls:
    """This process's certificate, key and the suite's CA, as PEM bytes."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str, key: str, ca: str, insecure: bool) -> Tls | None:
        """The files named by ``--tls-*``; None for ``--insecure``. ValueError says what is
        missing, naming the flags."""
        given = {"tls_cert": cert, "tls_key": key, "tls_ca": ca}
        if insecure:
            if any(given.values()):
                raise ValueError("insecure=True: drop --tls-cert/--tls-key/--tls-ca, or --insecure")
            return None
        missing = [name for name, value in given.items() if not value]
        if len(missing) == len(given):
            raise ValueError(
                "no certificates: pass --tls-cert, --tls-key and --tls-ca (mutual TLS with "
                "the suite's CA; `canteen certs DIR` makes them), or --insecure for plaintext"
            )
        if missing:
            raise ValueError(f"{', '.join(missing)}: required with the other --tls-* flags")
        return cls(_read("tls_cert", cert), _read("tls_key", key), _read("tls_ca", ca))

    @classmethod
    def from_folder(cls, folder: Path, role: str, worker_id: str = "") -> Tls:
        """``role``'s files (a worker's: ``worker_id``'s) in a folder made by
        ``canteen certs``."""
        cert = cert_path(folder, role, worker_id)
        return cls(
            cert.read_bytes(),
            cert.with_suffix(".key").read_bytes(),
            (folder / "ca.pem").read_bytes(),
        )

    @property
    def worker_id(self) -> str:
        """The worker id this certificate names ("" when it is not a worker's)."""
        return identity_of(self.cert).worker_id

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: the handshake demands a client certificate signed by the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def _options(
    tls: Tls | None, server_role: str, options: Sequence[tuple[str, object]]
) -> list[tuple[str, object]]:
    if tls is None:
        return list(options)
    return [("grpc.ssl_target_name_override", server_role), *options]


def aio_channel(
    address: str,
    tls: Tls | None,
    server_role: str,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """A channel to a suite service that must present ``server_role``'s certificate."""
    opts = _options(tls, server_role, options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)


def sync_channel(
    address: str,
    tls: Tls | None,
    server_role: str,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """The blocking twin of ``aio_channel`` (CLI tools, probes, tests)."""
    opts = _options(tls, server_role, options)
    if tls is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)


def worker_channel_name(worker_id: str) -> str:
    """The name a worker's certificate must carry for the scheduler to accept it as
    ``worker_id`` (canteen/certs.py makes it); plain ``worker`` for an id no certificate
    can name (only on plaintext links, where names are not checked)."""
    return worker_dns_name(worker_id) if WORKER_ID.fullmatch(worker_id) else "worker"


@dataclass(frozen=True)
class Peer:
    """Who called, by the role URI in its certificate."""

    role: str | None  # None: the certificate names no role, or more than one
    worker_id: str = ""  # a worker's id, from spiffe://canteen/worker/<id>


@functools.lru_cache(maxsize=256)
def identity_of(pem: bytes) -> Peer:
    """The role (and a worker's id) that a certificate's URI SANs name: exactly one
    ``spiffe://canteen/...`` URI, or no role at all."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return Peer(None)
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    ours = [u.removeprefix(URI_PREFIX) for u in uris if u.startswith(URI_PREFIX)]
    if len(ours) != 1:
        return Peer(None)
    role, _, worker_id = ours[0].partition("/")
    if role == "worker":
        return Peer("worker", worker_id) if WORKER_ID.fullmatch(worker_id) else Peer(None)
    return Peer(role) if role in ROLES and not worker_id else Peer(None)


def peer_identity(context: grpc.aio.ServicerContext) -> Peer | None:
    """The caller's identity; None on a plaintext link."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None
    return identity_of(bytes(next(iter(pems))))


def peer_role(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's role from its certificate's URI SAN; None on a plaintext link or for a
    certificate that names no role."""
    peer = peer_identity(context)
    return peer.role if peer is not None else None


@dataclass(frozen=True)
class Policy:
    """Which roles may call each method of a service (by method name); methods not named
    are open to every certificate the CA signed that names a role. Enforced only on TLS
    links."""

    rules: Mapping[str, frozenset[str]]

    @classmethod
    def of(cls, **rules: Iterable[str]) -> Policy:
        return cls({method: frozenset(roles) for method, roles in rules.items()})

    def refusal(self, method: str, role: str | None) -> str | None:
        """Why a caller of ``role`` may not call ``method`` (a full /pkg.Svc/Method path);
        ``role`` None: the certificate names no role."""
        if role is None:
            return (
                f"{method.rpartition('/')[2]}: this caller's certificate names no role; the "
                f"rule is exactly one URI SAN {URI_PREFIX}<role> (or {URI_PREFIX}worker/<id>)"
            )
        allowed = self.rules.get(method.rpartition("/")[2])
        if allowed is None or role in allowed:
            return None
        return (
            f"{method.rpartition('/')[2]} is open to {', '.join(sorted(allowed))} only; "
            f"this caller's certificate is for {role!r}"
        )


@dataclass(frozen=True)
class InternalLinkOptions:
    """The flags every service shares for its internal links (a base of each config)."""

    tls_cert: str = option("", TLS_CERT_HELP)
    tls_key: str = option("", TLS_KEY_HELP)
    tls_ca: str = option("", TLS_CA_HELP)
    insecure: bool = option(False, INSECURE_HELP)
    health_port: int = option(-1, HEALTH_PORT_HELP)

    def load_tls(self, service: str, worker_id: str = "") -> Tls | None:
        """The service's TLS material, or None for ``--insecure`` (logged as a warning);
        a missing or half-given set of flags, or a worker certificate for another
        ``worker_id``, exits with status 2 and the reason."""
        try:
            tls = Tls.load(self.tls_cert, self.tls_key, self.tls_ca, self.insecure)
        except ValueError as exc:
            print(f"{service}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if tls is not None and worker_id and tls.worker_id != worker_id:
            print(
                f"{service}: error: worker_id={worker_id!r}: the certificate "
                f"{self.tls_cert} is for worker {tls.worker_id!r}; one certificate is one "
                "worker (leave --worker-id out to take the certificate's)",
                file=sys.stderr,
            )
            raise SystemExit(2)
        if tls is None:
            get_logger(service).warning(
                "internal links in plaintext (--insecure): anyone who reaches this port can "
                "call it; use --tls-cert/--tls-key/--tls-ca in production"
            )
        return tls
