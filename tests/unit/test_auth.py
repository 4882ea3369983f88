"""API keys: the keys file format, model scoping, per-key limits and the old check()."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from canteen.auth import (
    ANONYMOUS,
    ApiKeys,
    AuthenticationError,
    KeySpec,
    ModelNotAllowedError,
    Principal,
    PriorityNotAllowedError,
    key_id,
    parse_key_line,
)


def write_keys(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


def test_key_id_is_the_first_8_hex_digits_of_the_sha256() -> None:
    assert key_id("secret") == hashlib.sha256(b"secret").hexdigest()[:8]
    assert ApiKeys(["secret"]).authenticate("Bearer secret").key_id == key_id("secret")


def test_keys_file_lines_scope_models_and_limits(tmp_path: Path) -> None:
    path = write_keys(
        tmp_path,
        "# team keys\n"
        "sk-all\n"
        "\n"
        "sk-two   models=smollm2,tiny\n"
        "  sk-own models=tiny rpm=30 tpm=0 priority=3  \n",
    )
    keys = ApiKeys.load(path, "")

    everything = keys.authenticate("Bearer sk-all")
    two = keys.authenticate("Bearer sk-two")
    own = keys.authenticate("bearer sk-own")

    # A key without priority= may ask for priority 0 at most.
    assert everything == Principal(key_id("sk-all"), max_priority=0)
    assert two == Principal(key_id("sk-two"), frozenset({"smollm2", "tiny"}), max_priority=0)
    assert own == Principal(key_id("sk-own"), frozenset({"tiny"}), rpm=30, tpm=0, max_priority=3)
    own.require_priority(3)
    with pytest.raises(
        PriorityNotAllowedError, match=r"priority=4: API key \w+ may ask for at most 3"
    ):
        own.require_priority(4)
    assert [p.key_id for p in keys.principals] == [
        key_id(k) for k in ("sk-all", "sk-two", "sk-own")
    ]


def test_env_keys_and_file_keys_both_work(tmp_path: Path) -> None:
    keys = ApiKeys.load(write_keys(tmp_path, "from-file models=tiny\n"), " one , two,, ")

    assert keys.authenticate("Bearer one").models is None
    assert keys.authenticate("Bearer two").models is None
    assert keys.authenticate("Bearer from-file").models == frozenset({"tiny"})


def test_keys_are_kept_only_as_digests() -> None:
    keys = ApiKeys([KeySpec("sk-very-secret", frozenset({"tiny"}))])
    assert "sk-very-secret" not in repr(vars(keys))
    assert "sk-very-secret" not in repr(KeySpec("sk-very-secret"))


def test_principal_allows_only_its_models() -> None:
    scoped = Principal("abcd1234", frozenset({"smollm2", "tiny"}))

    assert scoped.allows("tiny") and scoped.allows("smollm2")
    assert scoped.allows("tiny:3")  # a name:version ref of an allowed model
    assert not scoped.allows("llama")
    assert Principal("abcd1234").allows("anything")
    with pytest.raises(ModelNotAllowedError) as info:
        scoped.require_model("x")
    assert str(info.value) == "API key abcd1234 may not use model 'x' (allowed: smollm2, tiny)"
    assert info.value.key_id == "abcd1234" and info.value.model == "x"
    scoped.require_model("tiny")  # no error


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing authorization metadata; send 'authorization: Bearer KEY'"),
        ("", "missing authorization metadata; send 'authorization: Bearer KEY'"),
        ("secret", "authorization must be 'Bearer KEY'"),
        ("Basic secret", "authorization must be 'Bearer KEY'"),
        ("Bearer ", "authorization must be 'Bearer KEY'"),
        ("Bearer wrong", "invalid API key"),
    ],
)
def test_authenticate_and_check_give_the_same_reason(header: str | None, reason: str) -> None:
    keys = ApiKeys(["secret"])

    with pytest.raises(AuthenticationError) as info:
        keys.authenticate(header)

    assert info.value.reason == reason == str(info.value)
    assert keys.check(header) == reason


def test_check_accepts_a_valid_key_as_before() -> None:
    keys = ApiKeys(["one", "two"])
    assert keys.is_enabled
    assert keys.check("Bearer two") is None
    assert keys.check("Bearer  two ") is None


def test_without_keys_everyone_is_anonymous() -> None:
    keys = ApiKeys.load("", "")

    assert not keys.is_enabled
    assert keys.authenticate(None) is ANONYMOUS
    assert keys.check(None) is None
    assert ANONYMOUS.models is None and ANONYMOUS.rpm is None and ANONYMOUS.tpm is None


def test_identical_duplicates_are_merged_and_conflicting_ones_refused(tmp_path: Path) -> None:
    same = ApiKeys.load(write_keys(tmp_path, "dup\n"), "dup")
    assert len(same.principals) == 1

    with pytest.raises(ValueError, match=rf"API key {key_id('dup')} is listed twice"):
        ApiKeys.load(write_keys(tmp_path, "dup models=tiny\n"), "dup")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("k models=", "models='': must be a comma-separated list of model names"),
        ("k models=a,,b", "models='a,,b': must be a comma-separated list"),
        ("k rpm=ten", "rpm='ten': must be a whole number >= 0"),
        ("k tpm=-5", "tpm='-5': must be a whole number >= 0"),
        ("k rpm=1 rpm=2", "option rpm= is given twice"),
        ("k color=red", "unknown option 'color'; options are models=, rpm=, tpm= and priority="),
        ("k priority=high", "priority='high': must be a whole number in -1000..1000"),
        ("k priority=5000", "priority='5000': must be a whole number in -1000..1000"),
        ("my secret key", "unexpected text after the key"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_keys(tmp_path, f"# header\ngood\n{line}\n")

    with pytest.raises(ValueError) as info:
        ApiKeys.load(path, "")

    assert str(info.value).startswith(f"api_keys_file={path!r} line 3: ")
    assert message in str(info.value)
    assert "secret" not in str(info.value)  # never echo what may be part of a key


def test_missing_keys_file_is_an_error() -> None:
    with pytest.raises(ValueError, match="api_keys_file='/no/such/keys': no such file"):
        ApiKeys.load("/no/such/keys", "")


def test_parse_key_line_reads_every_option() -> None:
    spec = parse_key_line("k models=a rpm=0 tpm=9000")
    assert (spec.key, spec.models, spec.rpm, spec.tpm) == ("k", frozenset({"a"}), 0, 9000)
