"""The ``canteen`` command: run the suite on a laptop, talk to it, manage models.

``generate`` and ``models`` never fall back to plaintext: they talk TLS when given (or, for
the registry, when they find ``canteen up``'s) certificates, plaintext only with
``--insecure``, which they say on stderr, and otherwise refuse with exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import grpc

from canteen import certs
from canteen.finish import finish_from_pb
from canteen.local import add_client_flags, admin_metadata, certs_dir, client_tls
from canteen.models import MAX_ALIAS_WEIGHT
from canteen.tls import Tls, aio_channel
from canteen.tools.bench import cli as bench_cli
from canteen.tools.chaos import cli as chaos_cli
from canteen.tools.up import cli as up_cli
from canteen.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)


def _finish_name(value: int) -> str:
    finish = finish_from_pb(value)
    return finish.value if finish is not None else str(value)


class PlaintextRefusedError(Exception):
    """No TLS settings and no ``--insecure``: the CLI will not guess plaintext (exit 2)."""


def _warn_insecure(what: str, address: str, secrets: str) -> None:
    print(
        f"warning: --insecure: plaintext to the {what} at {address}; {secrets} travel in clear",
        file=sys.stderr,
    )


def gateway_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """TLS to the gateway's public port (``--ca`` or ``--tls``), or plaintext with
    ``--insecure``; PlaintextRefusedError with none of them."""
    if args.insecure:
        _warn_insecure("gateway", args.address, "the prompt, the answer and the API key")
        return grpc.aio.insecure_channel(args.address)
    if not args.ca and not args.tls:
        raise PlaintextRefusedError(
            f"no TLS settings for the gateway at {args.address}: pass --ca FILE (the CA of "
            "its public certificate; CANTEEN_GATEWAY_CA), --tls (a certificate from a CA "
            "this system trusts), or --insecure for plaintext"
        )
    try:
        roots = Path(args.ca).read_bytes() if args.ca else None
    except OSError as exc:
        raise PlaintextRefusedError(f"--ca {args.ca}: {exc.strerror}") from None
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.aio.secure_channel(args.address, credentials, options)


def registry_tls(args: argparse.Namespace) -> Tls | None:
    """The client certificate for the registry; None (plaintext) only with ``--insecure``."""
    if args.insecure:
        _warn_insecure("registry", args.registry, "the admin key and the model records")
        return None
    try:
        tls = client_tls(args)
    except (ValueError, OSError) as exc:
        raise PlaintextRefusedError(str(exc)) from None
    if tls is None:
        raise PlaintextRefusedError(
            f"no client certificate for the registry at {args.registry}: pass --tls-cert, "
            f"--tls-key and --tls-ca (CANTEEN_TLS_*), or run `canteen up`, whose certificates "
            f"are read from {certs_dir()}, or pass --insecure for plaintext"
        )
    return tls


async def _generate(args: argparse.Namespace) -> int:
    request = inference_pb2.GenerateRequest(model=args.model, ignore_eos=args.ignore_eos)
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    if args.max_tokens is not None:
        request.max_tokens = args.max_tokens
    if args.temperature is not None:
        request.temperature = args.temperature
    if args.seed is not None:
        request.seed = args.seed
    request.stop.extend(args.stop or [])
    api_key = args.api_key or os.environ.get("CANTEEN_API_KEY", "")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with gateway_channel(args) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            async for msg in stub.Generate(request, metadata=metadata, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    sys.stdout.write("\n")
                    u = msg.usage
                    print(
                        f"[{msg.model}] finish={_finish_name(msg.finish_reason)} "
                        f"prompt_tokens={u.prompt_tokens} completion_tokens="
                        f"{u.completion_tokens} cached_tokens={u.cached_tokens}",
                        file=sys.stderr,
                    )
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def parse_targets(text: str) -> list[tuple[str, int]]:
    """``V1=90,V2=10`` to ``[("V1", 90), ("V2", 10)]``; argparse reports the error."""
    targets: list[tuple[str, int]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        version, sep, weight = item.partition("=")
        if not sep or not version or not weight.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: use VERSION=WEIGHT, e.g. v1=90,v2=10")
        value = int(weight)
        if not 1 <= value <= MAX_ALIAS_WEIGHT:
            raise argparse.ArgumentTypeError(
                f"{item!r}: weight={value} must be in 1..{MAX_ALIAS_WEIGHT}"
            )
        targets.append((version.strip(), value))
    if not targets:
        raise argparse.ArgumentTypeError("--to needs at least one VERSION=WEIGHT")
    return targets


def format_alias(alias: registry_pb2.Alias) -> str:
    total = sum(t.weight for t in alias.targets) or 1
    shares = ", ".join(
        f"{alias.model}:{t.version}={t.weight} ({100 * t.weight / total:.1f}%)"
        for t in alias.targets
    )
    return f"alias {alias.name} -> {shares}"


def parse_add_spec(spec: str, name: str, version: str) -> tuple[str, str, str]:
    """``models add``'s model: PATH with --name and --version, or NAME:VERSION=PATH."""
    if name or version:
        if not (name and version):
            raise SystemExit("canteen models add: --name and --version go together")
        return name, version, spec
    ref, sep, path = spec.partition("=")
    name, _, version = ref.partition(":")
    if not (sep and name and version and path):
        raise SystemExit(
            f"canteen models add: {spec!r}: use NAME:VERSION=PATH, or PATH --name N --version V"
        )
    return name, version, path


async def _list_models(stub: registry_pb2_grpc.RegistryStub) -> None:
    listing = await stub.ListModels(registry_pb2.ListModelsRegistryRequest(), timeout=10)
    for m in listing.models:
        mark = "*" if m.name == listing.default_model else " "
        over = f"  base={m.base}" if m.base else ""
        print(f"{mark} {m.name}:{m.version}  max_model_len={m.max_model_len}{over}  {m.path}")
    for alias in listing.aliases:
        print(format_alias(alias))


async def _alias(stub: registry_pb2_grpc.RegistryStub, args: argparse.Namespace) -> None:
    admin = admin_metadata(args)
    if args.delete:
        await stub.DeleteAlias(
            registry_pb2.DeleteAliasRequest(name=args.name), timeout=10, metadata=admin
        )
        print(f"deleted alias {args.name}")
        return
    alias = registry_pb2.Alias(
        name=args.name,
        model=args.model or args.name,
        targets=[registry_pb2.AliasTarget(version=v, weight=w) for v, w in args.to],
    )
    stored = await stub.SetAlias(
        registry_pb2.SetAliasRequest(alias=alias), timeout=10, metadata=admin
    )
    print(format_alias(stored))


async def _models(args: argparse.Namespace) -> int:
    async with aio_channel(args.registry, registry_tls(args), "registry") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        try:
            if args.models_command == "add":
                name, version, path = parse_add_spec(args.path, args.name, args.version)
                record = registry_pb2.ModelRecord(
                    name=name, version=version, path=os.path.abspath(path), base=args.base
                )
                added = await stub.AddModel(
                    registry_pb2.AddModelRequest(model=record),
                    timeout=120,
                    metadata=admin_metadata(args),
                )
                over = f" (LoRA adapter of {added.base})" if added.base else ""
                print(f"added {added.name}:{added.version}{over} sha256={added.sha256}")
            elif args.models_command == "delete":
                name, _, version = args.ref.partition(":")
                await stub.DeleteModel(
                    registry_pb2.DeleteModelRequest(name=name, version=version),
                    timeout=10,
                    metadata=admin_metadata(args),
                )
                print(f"deleted {args.ref}")
            elif args.models_command == "alias":
                await _alias(stub, args)
            else:
                await _list_models(stub)
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _add_models_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = sub.add_parser("models", help="manage model records and aliases in the registry")
    models.add_argument("--registry", default=os.environ.get("CANTEEN_REGISTRY", "127.0.0.1:50053"))
    add_client_flags(models, admin=True)
    msub = models.add_subparsers(dest="models_command", required=True)
    add = msub.add_parser(
        "add",
        help="register a model version or a LoRA adapter",
        description="Registers NAME:VERSION=PATH (or PATH --name N --version V). A PEFT LoRA "
        "adapter folder (adapter_config.json + adapter_model.safetensors) needs --base.",
    )
    add.add_argument("path", metavar="NAME:VERSION=PATH")
    add.add_argument("--name", default="")
    add.add_argument("--version", default="")
    add.add_argument(
        "--base", default="", metavar="NAME:VERSION", help="a LoRA adapter's base model"
    )
    delete = msub.add_parser("delete", help="remove a model version")
    delete.add_argument("ref", metavar="NAME:VERSION")
    msub.add_parser("list", help="list model versions and aliases")
    alias = msub.add_parser(
        "alias",
        help="split a name's traffic across versions by weight",
        description="Requests naming NAME go to the --to versions in proportion to their "
        "weights; NAME:VERSION still pins one version.",
    )
    alias.add_argument("name", metavar="NAME", help="the name requests send")
    alias.add_argument(
        "--model", default="", help="the model whose versions --to names (default: NAME)"
    )
    action = alias.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--to", type=parse_targets, metavar="V1=90,V2=10", help="versions and weights (1..10000)"
    )
    action.add_argument("--delete", action="store_true", help="remove the alias")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canteen", description="Canteen LLM inference suite")
    sub = parser.add_subparsers(dest="command", required=True)

    up_cli.add_parser(sub)

    gen = sub.add_parser("generate", help="stream an answer to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    gen.add_argument("--model", default="")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--address", default=os.environ.get("CANTEEN_GATEWAY", "127.0.0.1:50051"))
    gen.add_argument("--api-key", default="")
    gen.add_argument("--timeout", type=float, default=None)
    transport = gen.add_mutually_exclusive_group()
    transport.add_argument(
        "--ca",
        default=os.environ.get("CANTEEN_GATEWAY_CA", ""),
        help="TLS: the CA (PEM) of the gateway's public certificate",
    )
    transport.add_argument("--tls", action="store_true", help="TLS with the CAs this system trusts")
    transport.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext: the prompt, the answer and the API key travel in clear",
    )
    gen.add_argument(
        "--server-name", default="", help="the name the gateway's certificate must carry"
    )

    cert_parser = sub.add_parser(
        "certs", help="make a throwaway CA and per-role certificates", add_help=False
    )
    cert_parser.add_argument("rest", nargs=argparse.REMAINDER)
    _add_models_parser(sub)
    bench_cli.add_parsers(sub)
    chaos_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:  # its own parser, flags and --help included
        certs.main(argv[1:])
        sys.exit(0)
    args = build_parser().parse_args(argv)
    if args.command == up_cli.COMMAND:
        sys.exit(up_cli.run(args))
    if args.command in bench_cli.COMMANDS:
        sys.exit(bench_cli.run(args))
    if args.command == chaos_cli.COMMAND:
        sys.exit(chaos_cli.run(args))
    try:
        run = _generate if args.command == "generate" else _models
        sys.exit(asyncio.run(run(args)))
    except PlaintextRefusedError as exc:
        print(f"canteen {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
