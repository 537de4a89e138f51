"""Ed25519 signatures over an artifact's manifest.json (which holds the sha256 of every other file).

Optional: needs the ``cryptography`` package (``pip install 'precast[sign]'``), imported only here and
only when a key is used. Keys are PEM files (PKCS#8 private, SubjectPublicKeyInfo public).
"""

from __future__ import annotations

import os
from pathlib import Path

from precast.runtime.errors import IntegrityError, UsageError, first_line

__all__ = ["SIGNATURE_NAME", "SignatureError", "generate_keypair", "sign_bytes", "verify_bytes"]

SIGNATURE_NAME = "manifest.sig"  # archive member: the raw 64-byte Ed25519 signature of manifest.json


class SignatureError(IntegrityError):
    """The signature is missing, malformed, or does not match the manifest and public key."""


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
    data: bytes, signature: bytes, public_key_pem: str | os.PathLike, where: str = "artifact"
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
            f"{where}: signature does not match manifest.json for public key {public_key_pem}"
        ) from None


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
