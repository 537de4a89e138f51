"""Ed25519 signatures over a signed statement: which artifact this is, which version, until when.

A signed pack carries two members after ``manifest.json``:

    statement.json   {"format": "precast-statement/2", "name": "encoder", "version": "4",
                      "manifest_sha256": "<sha256 of manifest.json>", "not_after": "2026-01-31T00:00:00Z"}
    statement.sig    the raw 64-byte Ed25519 signature of  b"precast signed statement\\n" + statement.json

``statement.json`` is canonical JSON (sorted keys, no spaces, ASCII): one spelling per statement, checked
byte for byte. manifest.json holds the sha256 of every other file, so the signature covers every byte of the
artifact *and* its identity: a verifier can require the name (``expect_name``), a least version
(``min_version``) and an unexpired statement, so an older signed pack cannot be replayed for a newer one.
``not_after`` is optional. Versions are dotted non-negative integers ("4", "1.2.3"), compared numerically.

Format v1 (``manifest.sig``: a signature of manifest.json alone, no name, version or expiry) is refused when
a signature is required: it cannot say which release it is.

Optional: needs the ``cryptography`` package (``pip install 'precast[sign]'``), imported only here and
only when a key is used. Keys are PEM files (PKCS#8 private, SubjectPublicKeyInfo public).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from precast.errors import IntegrityError, UsageError, first_line

__all__ = [
    "LEGACY_SIGNATURE_NAME",
    "STATEMENT_FORMAT",
    "STATEMENT_NAME",
    "STATEMENT_SIG_NAME",
    "SignatureError",
    "SignaturePolicy",
    "Statement",
    "check_name",
    "generate_keypair",
    "parse_expiry",
    "signature_policy",
    "sign_bytes",
    "sign_statement",
    "verify_bytes",
    "verify_statement",
    "version_key",
]

STATEMENT_NAME = "statement.json"  # archive member: the canonical statement bytes
STATEMENT_SIG_NAME = "statement.sig"  # archive member: the raw 64-byte Ed25519 signature of the statement
LEGACY_SIGNATURE_NAME = "manifest.sig"  # format v1 (manifest.json only): refused whenever a key is given
STATEMENT_FORMAT = "precast-statement/2"
MAX_STATEMENT_BYTES = 4096
_DOMAIN = b"precast signed statement\n"  # a statement signature can never pass for one over other bytes

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@/-]{0,127}")
_VERSION = re.compile(r"(0|[1-9][0-9]{0,17})(\.(0|[1-9][0-9]{0,17})){0,3}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TIME = "%Y-%m-%dT%H:%M:%SZ"  # how not_after is written: UTC, whole seconds
_DURATION = re.compile(r"([1-9][0-9]{0,4})([hdw])")
_KEYS = {"format", "name", "version", "manifest_sha256", "not_after"}


class SignatureError(IntegrityError):
    """The signature is missing, malformed or does not match, or the signed statement is not acceptable
    (another name, an older version, expired)."""


def check_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(
            f"{what} {name!r}: 1-128 characters of letters, digits and . _ + @ / -, starting with a letter "
            "or digit"
        )
    return name


def version_key(version: object, what: str = "version") -> tuple[int, ...]:
    """'1.2.0' -> (1, 2): dotted non-negative integers, compared numerically ('1.10' > '1.9', '1.0' == '1')."""
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise UsageError(
            f"{what} {version!r}: dotted non-negative integers such as 4 or 1.2.3 (at most 4 parts, no "
            "leading zeros, no 'v' or pre-release tag)"
        )
    parts = [int(p) for p in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _utc(when: datetime, what: str) -> datetime:
    if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
        raise UsageError(f"{what} must be a timezone-aware datetime, got {when!r}")
    return when.astimezone(timezone.utc)


def _now(now: datetime | None) -> datetime:
    return datetime.now(timezone.utc) if now is None else _utc(now, "now")


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """``--expires``: a date (2026-01-31: that day's start, UTC), an ISO 8601 time with a zone
    (2026-01-31T12:00:00Z, ...+02:00), or a span from ``now`` (36h, 90d, 2w). Must lie in the future."""
    now = _now(now)
    text = text.strip()
    span = _DURATION.fullmatch(text)
    if span:
        n, unit = int(span[1]), span[2]
        when = now + timedelta(hours=n) * {"h": 1, "d": 24, "w": 168}[unit]
    else:
        try:
            when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
            when.astimezone(timezone.utc)  # 9999-12-31T23:00-05:00 is past datetime's range in UTC
        except (ValueError, OverflowError):
            raise UsageError(
                f"--expires {text!r}: give a date (2026-01-31), a time with a zone (2026-01-31T12:00:00Z) "
                "or a span (36h, 90d, 2w)"
            ) from None
        if when.tzinfo is None:
            if len(text) != 10:  # a time without a zone: whose midnight?
                raise UsageError(f"--expires {text!r}: give the zone too (Z or +HH:MM)")
            when = when.replace(tzinfo=timezone.utc)
    when = when.astimezone(timezone.utc).replace(microsecond=0)
    if when <= now:
        raise UsageError(f"--expires {text!r} is not in the future ({when.strftime(_TIME)})")
    return when


@dataclass(frozen=True)
class Statement:
    """What a signature vouches for: the artifact's name and version, its manifest, and until when."""

    name: str
    version: str
    manifest_sha256: str
    not_after: datetime | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "signed name")
        if not isinstance(self.version, str):  # one spelling: "4", never 4
            raise UsageError(f"signed version {self.version!r} must be a string")
        version_key(self.version, "signed version")
        if not isinstance(self.manifest_sha256, str) or not _SHA256.fullmatch(self.manifest_sha256):
            raise UsageError(f"manifest_sha256 {self.manifest_sha256!r}: 64 lowercase hex digits")
        if self.not_after is not None:
            object.__setattr__(self, "not_after", _utc(self.not_after, "not_after").replace(microsecond=0))

    @classmethod
    def of(
        cls, manifest_bytes: bytes, name: str, version: str, not_after: datetime | None = None
    ) -> Statement:
        return cls(str(name), str(version), hashlib.sha256(manifest_bytes).hexdigest(), not_after)

    def to_json(self) -> dict:
        obj = {
            "format": STATEMENT_FORMAT,
            "name": self.name,
            "version": self.version,
            "manifest_sha256": self.manifest_sha256,
        }
        if self.not_after is not None:
            obj["not_after"] = self.not_after.strftime(_TIME)
        return obj

    def to_bytes(self) -> bytes:
        """The canonical bytes: sorted keys, no whitespace, ASCII only."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "artifact") -> Statement:
        """Parse signed statement bytes strictly: known keys, typed fields, canonical spelling."""

        def no_duplicates(pairs):
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise ValueError("a key appears twice")
            return dict(pairs)

        try:
            if len(data) > MAX_STATEMENT_BYTES:
                raise ValueError(f"{len(data)} bytes (limit {MAX_STATEMENT_BYTES})")
            obj = json.loads(data.decode("ascii"), object_pairs_hook=no_duplicates)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            if obj.get("format") != STATEMENT_FORMAT:
                raise ValueError(f"format {obj.get('format')!r}, expected {STATEMENT_FORMAT!r}")
            unknown = sorted(set(obj) - _KEYS)
            missing = sorted(_KEYS - {"not_after"} - set(obj))
            if unknown or missing:
                raise ValueError(f"unknown keys {unknown}" if unknown else f"missing keys {missing}")
            not_after = obj.get("not_after")
            if not_after is not None:
                if not isinstance(not_after, str):
                    raise ValueError("not_after is not a string")
                not_after = datetime.strptime(not_after, _TIME).replace(tzinfo=timezone.utc)
            statement = cls(obj["name"], obj["version"], obj["manifest_sha256"], not_after)
            if statement.to_bytes() != data:
                raise ValueError("not in canonical form (sorted keys, no whitespace, ASCII)")
        except (ValueError, UnicodeError, UsageError, RecursionError) as e:
            raise SignatureError(f"{where}: malformed {STATEMENT_NAME}: {first_line(e)}") from None
        return statement


@dataclass(frozen=True)
class SignaturePolicy:
    """What a verifier requires: a valid signature by ``pubkey``, and optionally the signed name and a least
    version. An expired statement is always refused."""

    pubkey: Path
    expect_name: str | None = None
    min_version: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pubkey", Path(self.pubkey))
        if self.expect_name is not None:
            check_name(self.expect_name, "--expect-name")
        if self.min_version is not None:
            version_key(self.min_version, "--min-version")
            object.__setattr__(self, "min_version", str(self.min_version))

    def check(self, statement: Statement, where: str = "artifact", now: datetime | None = None) -> None:
        """Raise SignatureError (one line naming what failed) unless ``statement`` meets this policy."""
        if self.expect_name is not None and statement.name != self.expect_name:
            raise SignatureError(
                f"{where}: signed for name '{statement.name}', not --expect-name '{self.expect_name}'"
            )
        if self.min_version is not None and version_key(statement.version) < version_key(self.min_version):
            raise SignatureError(
                f"{where}: signed version {statement.version} is older than --min-version {self.min_version}"
            )
        now = _now(now)
        if statement.not_after is not None and now >= statement.not_after:
            raise SignatureError(
                f"{where}: signed statement expired at {statement.not_after.strftime(_TIME)} "
                f"(now {now.replace(microsecond=0).strftime(_TIME)})"
            )


def signature_policy(
    pubkey: str | os.PathLike | None, expect_name: str | None = None, min_version: str | None = None
) -> SignaturePolicy | None:
    """The policy the ``--pubkey/--expect-name/--min-version`` options ask for (None: no signature required)."""
    if pubkey is None:
        given = [
            o for o, v in (("--expect-name", expect_name), ("--min-version", min_version)) if v is not None
        ]
        if given:
            raise UsageError(f"{' and '.join(given)} check the signed statement: give --pubkey too")
        return None
    return SignaturePolicy(Path(pubkey), expect_name, min_version)


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise UsageError("signing needs the 'cryptography' package: pip install 'precast[sign]'") from None
    return serialization, ed25519, InvalidSignature


def _read_pem(path: str | os.PathLike, what: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{what} not found: {p}")
    data = p.read_bytes()
    if len(data) > 64 * 1024:
        raise UsageError(f"{what} {p} is too large to be a PEM key")
    return data


def _private_key(path: str | os.PathLike):
    serialization, ed25519, _ = _crypto()
    try:
        key = serialization.load_pem_private_key(_read_pem(path, "signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise UsageError(f"signing key {path}: not an unencrypted PEM private key ({first_line(e)})") from e
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UsageError(f"signing key {path}: expected an Ed25519 key, got {type(key).__name__}")
    return key


def _public_key(path: str | os.PathLike):
    serialization, ed25519, _ = _crypto()
    try:
        key = serialization.load_pem_public_key(_read_pem(path, "public key"))
    except (ValueError, TypeError) as e:
        raise UsageError(f"public key {path}: not a PEM public key ({first_line(e)})") from e
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise UsageError(f"public key {path}: expected an Ed25519 key, got {type(key).__name__}")
    return key


def sign_bytes(data: bytes, private_key_pem: str | os.PathLike) -> bytes:
    return _private_key(private_key_pem).sign(data)


def verify_bytes(
    data: bytes,
    signature: bytes,
    public_key_pem: str | os.PathLike,
    where: str = "artifact",
    what: str = "manifest.json",
) -> None:
    """Raise SignatureError unless ``signature`` is a valid Ed25519 signature of ``data``."""
    _, _, invalid = _crypto()
    key = _public_key(public_key_pem)
    if len(signature) != 64:
        raise SignatureError(f"{where}: malformed signature ({len(signature)} bytes, expected 64)")
    try:
        key.verify(signature, data)
    except invalid:
        raise SignatureError(
            f"{where}: signature does not match {what} for public key {public_key_pem}"
        ) from None


def sign_statement(statement: Statement, private_key_pem: str | os.PathLike) -> bytes:
    """The raw Ed25519 signature of ``statement``'s canonical bytes (domain-separated)."""
    return sign_bytes(_DOMAIN + statement.to_bytes(), private_key_pem)


def verify_statement(
    statement_bytes: bytes,
    signature: bytes,
    manifest_bytes: bytes,
    policy: SignaturePolicy,
    where: str = "artifact",
    now: datetime | None = None,
) -> Statement:
    """Check, in order: the signature (by ``policy.pubkey``) over the statement bytes, the statement's form,
    that it names these manifest bytes, then the policy (name, least version, expiry at ``now``)."""
    verify_bytes(_DOMAIN + statement_bytes, signature, policy.pubkey, where, STATEMENT_NAME)
    statement = Statement.from_bytes(statement_bytes, where)
    actual = hashlib.sha256(manifest_bytes).hexdigest()
    if statement.manifest_sha256 != actual:
        raise SignatureError(
            f"{where}: the signed statement names manifest sha256 {statement.manifest_sha256[:12]}..., "
            f"manifest.json is {actual[:12]}..."
        )
    policy.check(statement, where, now)
    return statement


def generate_keypair(private_out: str | os.PathLike, public_out: str | os.PathLike) -> None:
    """Write a new Ed25519 key pair as PEM files (the private one with mode 0600)."""
    serialization, ed25519, _ = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for path in (private_out, public_out):
        if Path(path).exists():
            raise UsageError(f"{path} exists; refusing to overwrite a key")
    fd = os.open(private_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    Path(public_out).write_bytes(pub)
