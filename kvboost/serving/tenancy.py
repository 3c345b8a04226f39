"""API keys and tenants: which key a request carries, and the cache salt the server derives from it.

Every cache key of a request carries its salt (the engine hashes it into the chunk keys), so two tenants never hit
each other's entries. The salt of a tenant is ``HMAC-SHA256(server secret, API key)``: a client never chooses it and
cannot compute another tenant's, and the same key gets the same salt after a restart as long as the secret is the
same (so the disk tier's records stay reachable). A request's own ``cache_salt`` (vLLM's field) is appended to the
tenant's salt, never put in its place. Without keys every request belongs to one open tenant whose salt is empty.

The secret comes from ``--salt-secret`` / ``KVBOOST_SALT_SECRET``, else from ``$KVBOOST_CACHE_DIR/server_secret``
(created on first use, mode 0600). A random per-process secret would be safer against a stolen file but would make
every restart miss the whole disk tier, which is the point of the tier.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvboost.paths import kvboost_cache_dir

SECRET_FILE = "server_secret"
KEYS_ENV = "KVBOOST_API_KEYS"
SECRET_ENV = "KVBOOST_SALT_SECRET"


class AuthError(Exception):
    """The request's API key is missing or unknown (answered 401)."""


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: ``salt`` goes into every cache key; ``tenant_id`` is a short, non-secret label for
    metrics (the first 8 hex digits of the salt's SHA-256)."""

    salt: str
    tenant_id: str

    def cache_salt(self, request_salt: str | None) -> str:
        """The salt of one request: the tenant's, with the request's own ``cache_salt`` appended."""
        if not request_salt:
            return self.salt
        # The tenant part has a fixed length (64 hex digits, or empty without keys), so the separator keeps
        # "tenant + request salt" from ever spelling another tenant's salt.
        return f"{self.salt}|{request_salt}"


def tenant_label(salt: str) -> str:
    """Short id of a salt, safe to publish (a hash prefix; the salt cannot be recovered from it)."""
    return hashlib.sha256(salt.encode()).hexdigest()[:8]


OPEN_TENANT = Tenant(salt="", tenant_id=tenant_label(""))


def keys_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """API keys from ``KVBOOST_API_KEYS`` (comma-separated; blanks dropped)."""
    raw = (environ if environ is not None else os.environ).get(KEYS_ENV, "")
    return [k.strip() for k in raw.split(",") if k.strip()]


def load_or_create_secret(path: Path | None = None) -> bytes:
    """The server secret kept in ``path`` (default ``$KVBOOST_CACHE_DIR/server_secret``), created with 0600
    permissions on first use. A file readable by others is refused: anyone who reads it can compute every
    tenant's salt from its key."""
    path = Path(path) if path is not None else kvboost_cache_dir() / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: two servers starting together agree on one secret (the loser reads the winner's file).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise PermissionError(
                f"{path} is readable by other users (mode {mode:o}); run `chmod 600 {path}` or pass --salt-secret"
            ) from None
        secret = path.read_bytes().strip()
        if not secret:
            raise ValueError(f"{path} is empty; delete it (a new secret is made) or pass --salt-secret")
        return secret
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
        f.flush()
        os.fsync(f.fileno())
    return path.read_bytes().strip()


class Tenancy:
    """Maps the ``Authorization: Bearer <key>`` header of a request to its :class:`Tenant`.

    ``api_keys`` empty or None: no authentication, one open tenant. ``secret``: the HMAC key (str or bytes); None
    loads (or creates) the stored secret, and only when there are keys to salt.
    """

    def __init__(self, api_keys: Iterable[str] | None = None, secret: str | bytes | None = None) -> None:
        keys = [k for k in (api_keys or []) if k]
        self.enabled = bool(keys)
        self._tenants: dict[str, Tenant] = {}
        if not self.enabled:
            return
        if secret is None:
            secret = load_or_create_secret()
        key_bytes = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not key_bytes:
            raise ValueError("the salt secret must not be empty")
        for key in keys:
            salt = hmac.new(key_bytes, key.encode(), hashlib.sha256).hexdigest()
            self._tenants[key] = Tenant(salt=salt, tenant_id=tenant_label(salt))

    @property
    def tenant_ids(self) -> list[str]:
        """Labels of the configured tenants (the open tenant's when there are no keys)."""
        return [t.tenant_id for t in self._tenants.values()] if self.enabled else [OPEN_TENANT.tenant_id]

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header value; :class:`AuthError` when keys are configured and the
        header carries none of them."""
        if not self.enabled:
            return OPEN_TENANT
        if not authorization:
            raise AuthError("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError("malformed Authorization header: expected 'Bearer <key>'")
        # compare_digest against every key: the time taken says nothing about which key is close.
        found = None
        for key, tenant in self._tenants.items():
            if hmac.compare_digest(key.encode(), token.encode()):
                found = tenant
        if found is None:
            raise AuthError("invalid API key")
        return found
