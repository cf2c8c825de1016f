"""Who may have written what kernel_api runs: the permission rule for cache folders and entries,
and the keys trusted to sign bundles.

Compiled artifacts are executable code: a CuTe DSL object is linked into the process and called,
a cubin runs on the GPU. Whoever can write a cache entry, or the folder that holds it, can run
code in every process that loads it. docs/security.md states the rules for users.

**Permission rule** (ssh's ``StrictModes``, pip's cache check). A file or folder is trusted when
it is owned by this process's user or by root, and no one else can write it: no write bit for
others, and a group write bit only when that group has no member but the owner (the private
group of umask-002 systems). A folder with the sticky bit (``/tmp``) may be writable by others:
they can add files there but not replace or rename ours, and what they add is owned by them, so
the rule refuses it. Checks run on ``os.stat`` results, so a caller can ``fstat`` the file it
has opened (no window between the check and the read).

**Bundle signatures** (optional; they need the ``cryptography`` package). A bundle's maker signs
its manifest, which holds every other file's SHA-256, with an Ed25519 key
(``ssh-keygen -t ed25519`` or ``openssl genpkey -algorithm ed25519`` makes one); a user lists the
public keys they trust with ``kernel-api trust add KEY.pub``, kept in ``trusted_keys`` under
`config_dir` (one OpenSSH public-key line each), a file the permission rule also covers.
"""

from __future__ import annotations

import base64
import functools
import grp
import hashlib
import os
import pwd
import stat
from pathlib import Path
from typing import Any, NamedTuple

from .errors import KernelApiError
from .files import atomic_file

ENV_CONFIG_DIR = "KERNEL_API_CONFIG_DIR"
KEYS_FILE = "trusted_keys"
_SIGNED_PREFIX = b"kernel_api bundle manifest v1\n"  # signatures are over this + the manifest's bytes
_KEY_TYPE = "ssh-ed25519"


class TrustError(KernelApiError):
    """A key, signature or trusted-keys file that cannot be used; the message names it and why."""


# ---- the permission rule -------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _private_group(gid: int, owner: int) -> bool:
    """True when group ``gid`` has exactly one member, the user ``owner`` (as primary group or
    as its only listed member)."""
    try:
        group = grp.getgrgid(gid)
        owner_name = pwd.getpwuid(owner).pw_name
    except KeyError:
        return False
    members = {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid} | set(group.gr_mem)
    return members == {owner_name}


def stat_problem(st: os.stat_result, uid: int | None = None) -> str | None:
    """Why a file or folder with status ``st`` must not be trusted, or None when it may.

    Args:
        st: ``os.stat``/``os.fstat`` of the file or folder.
        uid: the user who would trust it (default: this process's effective user).

    Returns:
        e.g. "is owned by uid 1001" or "is writable by others (mode 0o777)"; None when trusted.
    """
    uid = os.geteuid() if uid is None else uid
    if st.st_uid not in (uid, 0):
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return f"is writable by others (mode {mode:#o})"
    if mode & stat.S_IWGRP and not _private_group(st.st_gid, st.st_uid):
        return f"is writable by its group, gid {st.st_gid} (mode {mode:#o})"
    return None


def path_problem(path: str | os.PathLike) -> str | None:
    """`stat_problem` of ``path`` (symbolic links followed), prefixed with the path; None when
    it is trusted, or cannot be reached (missing, or behind a folder this user cannot search:
    then nothing can be read through it either).

    Args:
        path: a file or folder.

    Returns:
        e.g. "/cache/kernel_api is writable by others (mode 0o777)", or None.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    problem = stat_problem(st)
    return None if problem is None else f"{os.fspath(path)} {problem}"


# ---- trusted keys and signatures -------------------------------------------------------------

class TrustedKey(NamedTuple):
    """A public key trusted to sign bundles: its ssh-style fingerprint (``SHA256:...``, what
    ``ssh-keygen -l`` prints), its OpenSSH line (``ssh-ed25519 AAAA... comment``)."""

    fingerprint: str
    line: str


def config_dir() -> Path:
    """The user's kernel_api configuration folder: ``$KERNEL_API_CONFIG_DIR``, else the
    platform's user config folder."""
    explicit = os.environ.get(ENV_CONFIG_DIR)
    if explicit:
        return Path(explicit).expanduser()
    try:
        import platformdirs
    except ImportError:
        base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        return Path(base) / "kernel_api"
    return Path(platformdirs.user_config_dir("kernel_api", appauthor=False))


class _Crypto(NamedTuple):
    serialization: Any
    ed25519: Any
    exceptions: Any


def _crypto(purpose: str) -> _Crypto:
    """The parts of ``cryptography`` that signatures use, or `TrustError` saying how to install it."""
    try:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise TrustError(f"{purpose} needs the cryptography package, which is not installed: "
                         f"pip install 'kernel_api[sign]' (or pip install cryptography)") from None
    return _Crypto(serialization, ed25519, exceptions)


def _fingerprint(openssh_line: bytes) -> str:
    blob = base64.b64decode(openssh_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _key_line(public: Any, comment: str) -> TrustedKey:
    serialization = _crypto("trusted keys").serialization
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    text = line.decode() + (f" {comment}" if comment else "")
    return TrustedKey(_fingerprint(line), text)


def read_public_key(path: str | os.PathLike) -> TrustedKey:
    """The Ed25519 public key in ``path``: an OpenSSH line (``ssh-keygen``'s ``.pub``) or PEM.

    Args:
        path: the public key file.

    Returns:
        The key, its comment kept (or the file's name when it has none).

    Raises:
        TrustError: unreadable, not a public key, not Ed25519, or ``cryptography`` missing.
    """
    crypto = _crypto("trusting a signing key")
    source = f"key {os.fspath(path)}"
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise TrustError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    comment = Path(path).name
    try:
        if data.startswith(b"ssh-"):
            fields = data.split(None, 2)
            comment = fields[2].decode(errors="replace").strip() if len(fields) > 2 else comment
            public = crypto.serialization.load_ssh_public_key(b" ".join(fields[:2]))
        else:
            public = crypto.serialization.load_pem_public_key(data)
    except (ValueError, TypeError, IndexError, crypto.exceptions.UnsupportedAlgorithm) as exc:
        raise TrustError(f"{source}: not a public key in OpenSSH or PEM form ({exc})") from None
    if not isinstance(public, crypto.ed25519.Ed25519PublicKey):
        raise TrustError(f"{source}: a {type(public).__name__}; bundle signatures use Ed25519 keys "
                         f"(ssh-keygen -t ed25519)")
    return _key_line(public, comment.replace("\n", " "))


def _keys_path() -> Path:
    return config_dir() / KEYS_FILE


def trusted_keys() -> list[TrustedKey]:
    """The keys listed in the trusted-keys file (none when it does not exist).

    Returns:
        One `TrustedKey` per valid line, in file order.

    Raises:
        TrustError: the file, or its folder, is writable by others or owned by another user (it
            could list anyone's key), or cannot be read.
    """
    path = _keys_path()
    for item in (path.parent, path):
        problem = path_problem(item)
        if problem is not None:
            raise TrustError(f"trusted keys: {problem}; not using it (chmod go-w, or chown it)")
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise TrustError(f"trusted keys {path}: cannot read it ({exc.strerror or exc})") from None
    keys = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == _KEY_TYPE:
            try:
                keys.append(TrustedKey(_fingerprint(line.encode()), line.strip()))
            except ValueError:  # a damaged line: it trusts nothing
                continue
    return keys


def _write_keys(keys: list[TrustedKey]) -> None:
    path = _keys_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with atomic_file(path, "w") as f:  # a temporary file of mode 0600, renamed over the list
        f.write("".join(k.line + "\n" for k in keys))


def add_trusted_key(path: str | os.PathLike) -> TrustedKey:
    """Trust the public key in ``path`` to sign bundles (listing it again changes nothing).

    Args:
        path: an Ed25519 public key (see `read_public_key`).

    Returns:
        The key added (or already listed).
    """
    key = read_public_key(path)
    keys = trusted_keys()
    if all(k.fingerprint != key.fingerprint for k in keys):
        _write_keys(keys + [key])
    return key


def remove_trusted_key(fingerprint: str) -> TrustedKey:
    """Stop trusting the key with ``fingerprint`` (``SHA256:...``, as `trusted_keys` lists).

    Returns:
        The key removed.

    Raises:
        TrustError: no listed key has that fingerprint.
    """
    keys = trusted_keys()
    found = [k for k in keys if k.fingerprint == fingerprint]
    if not found:
        raise TrustError(f"no trusted key has fingerprint {fingerprint!r} (`kernel-api trust list` lists them)")
    _write_keys([k for k in keys if k.fingerprint != fingerprint])
    return found[0]


def sign_manifest(manifest: bytes, private_key: str | os.PathLike) -> dict[str, str]:
    """A detached signature of a bundle's manifest.

    Args:
        manifest: the manifest's bytes, exactly as the bundle stores them.
        private_key: an unencrypted Ed25519 private key file (OpenSSH or PEM).

    Returns:
        ``{"algorithm": "ed25519", "key": fingerprint, "signature": base64}``.

    Raises:
        TrustError: the key cannot be read, is encrypted or not Ed25519, or ``cryptography`` is missing.
    """
    crypto = _crypto("signing a bundle")
    source = f"signing key {os.fspath(private_key)}"
    try:
        data = Path(private_key).read_bytes()
    except OSError as exc:
        raise TrustError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = crypto.serialization.load_ssh_private_key(data, password=None)
        else:
            key = crypto.serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, crypto.exceptions.UnsupportedAlgorithm) as exc:
        raise TrustError(f"{source}: not an unencrypted private key in OpenSSH or PEM form ({exc})") from None
    if not isinstance(key, crypto.ed25519.Ed25519PrivateKey):
        raise TrustError(f"{source}: a {type(key).__name__}; bundles are signed with Ed25519 keys "
                         f"(ssh-keygen -t ed25519)")
    return {"algorithm": "ed25519", "key": _key_line(key.public_key(), "").fingerprint,
            "signature": base64.b64encode(key.sign(_SIGNED_PREFIX + manifest)).decode()}


def verify_manifest(manifest: bytes, signature: Any, source: str) -> TrustedKey:
    """The trusted key whose signature ``signature`` (as `sign_manifest` returns) ``manifest``
    carries.

    Args:
        manifest: the manifest's bytes.
        signature: the decoded signature document.
        source: what is checked, for messages (e.g. "bundle x.tar").

    Raises:
        TrustError: the signature is malformed, by a key not listed as trusted, or does not
            match the manifest; ``cryptography`` is missing.
    """
    crypto = _crypto(f"{source}: checking its signature")
    if not isinstance(signature, dict) or signature.get("algorithm") != "ed25519" or not all(
            isinstance(signature.get(k), str) for k in ("key", "signature")):
        raise TrustError(f"{source}: its signature is malformed (needs algorithm ed25519, key and signature)")
    keys = [k for k in trusted_keys() if k.fingerprint == signature["key"]]
    if not keys:
        raise TrustError(f"{source}: signed by key {signature['key']}, which is not trusted here "
                         f"(`kernel-api trust add KEY.pub` trusts it; --trust installs without a signature)")
    public = crypto.serialization.load_ssh_public_key(" ".join(keys[0].line.split()[:2]).encode())
    try:
        public.verify(base64.b64decode(signature["signature"], validate=True), _SIGNED_PREFIX + manifest)
    except (crypto.exceptions.InvalidSignature, ValueError):
        raise TrustError(f"{source}: its signature by {signature['key']} does not match its manifest "
                         f"(tampered with, or damaged)") from None
    return keys[0]
