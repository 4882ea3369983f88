"""What ``canteen up`` keeps in its data folder, and how the CLI tools find it.

    DATA/registry.db          the registry's models and aliases
    DATA/certs/               the throwaway CA and per-role certificates (canteen/certs.py)
    DATA/admin.key            the admin key of the registry's writes (one line, mode 0600)

DATA is ``$CANTEEN_DATA_DIR``, else ``$XDG_DATA_HOME/canteen``, else ``~/.local/share/canteen``.
A CLI tool that talks to an internal service uses, in order: its ``--tls-*`` flags, the
``CANTEEN_TLS_*`` variables, the client certificate in DATA/certs; ``--insecure`` uses none.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from canteen.tls import Tls


def data_dir() -> Path:
    explicit = os.environ.get("CANTEEN_DATA_DIR")
    if explicit:
        return Path(explicit)
    root = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(root) / "canteen"


def certs_dir() -> Path:
    return data_dir() / "certs"


def admin_key_file() -> Path:
    return data_dir() / "admin.key"


def ensure_admin_key() -> Path:
    """The admin key file, made (random, mode 0600) if it does not exist yet."""
    path = admin_key_file()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"canteen-admin-{secrets.token_urlsafe(24)}\n")
    return path


def add_client_flags(parser: argparse.ArgumentParser, admin: bool = False) -> None:
    """``--tls-cert/--tls-key/--tls-ca/--insecure`` (and ``--admin-key``) of a CLI tool."""
    env = os.environ
    parser.add_argument("--tls-cert", default=env.get("CANTEEN_TLS_CERT", ""))
    parser.add_argument("--tls-key", default=env.get("CANTEEN_TLS_KEY", ""))
    parser.add_argument("--tls-ca", default=env.get("CANTEEN_TLS_CA", ""))
    parser.add_argument(
        "--insecure", action="store_true", help="plaintext (a suite started with --insecure)"
    )
    if admin:
        parser.add_argument(
            "--admin-key",
            default=env.get("CANTEEN_ADMIN_KEY", ""),
            help="admin key for registry writes (default: canteen up's DATA/admin.key)",
        )


def client_tls(args: argparse.Namespace) -> Tls | None:
    """The client certificate a CLI tool presents; None for plaintext."""
    if args.insecure:
        return None
    if args.tls_cert or args.tls_key or args.tls_ca:
        return Tls.load(args.tls_cert, args.tls_key, args.tls_ca, insecure=False)
    folder = certs_dir()
    if (folder / "client.pem").exists():
        return Tls.from_folder(folder, "client")
    return None


def admin_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``authorization`` metadata carrying the admin key, when one is known."""
    key = args.admin_key
    if not key and admin_key_file().exists():
        key = admin_key_file().read_text().split()[0]
    return (("authorization", f"Bearer {key}"),) if key else ()
