"""Secrets kept out of what kvboost prints and logs: command lines with ``--api-key`` / ``--salt-secret`` (and
overrides such as ``engine.kv_events.salt_key=...``, passwords in URLs) shown redacted, and a logging filter that
replaces the secret values in every log record that reaches the root logger's handlers.

Used by ``python -m kvboost.serving.ray``, which builds the replicas' command line (with the salt secret it may
generate) and used to print it whole. Redacting by value as well as by position matters: a secret can reach a log
line through another path (an exception message quoting an argument), and the filter catches it there too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
#: flags whose value is a secret
SECRET_FLAGS = ("--api-key", "--salt-secret")
#: an override whose key contains one of these holds a secret (``engine.kv_events.salt_key=...``)
SECRET_KEY_WORDS = ("secret", "password", "passwd", "api_key", "apikey", "token", "salt_key")
#: environment variables whose values are secrets (comma-separated lists for the keys)
SECRET_ENV = ("KVBOOST_API_KEYS", "KVBOOST_SALT_SECRET", "KVBOOST_KV_EVENTS_KEY")


def _url_password(value: str) -> str | None:
    """The password of a URL (``redis://:pw@host:6379/0``), or None."""
    if "://" not in value or "@" not in value:
        return None
    try:
        return urlsplit(value).password or None
    except ValueError:
        return None


def _redact_url(value: str) -> str:
    parts = urlsplit(value)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:" if parts.username else ":"
    return urlunsplit((parts.scheme, f"{user}{REDACTED}@{host}", parts.path, parts.query, parts.fragment))


def _secret_override(arg: str) -> bool:
    key = arg.split("=", 1)[0].lower()
    return "=" in arg and not arg.startswith("-") and any(word in key for word in SECRET_KEY_WORDS)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret replaced by ``***``: the value after (or ``=`` in) ``--api-key`` /
    ``--salt-secret``, the value of a secret-named ``KEY=VALUE`` override, a URL's password."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        if _secret_override(arg):
            out.append(f"{flag}={REDACTED}")
            continue
        value = arg.split("=", 1)[1] if "=" in arg and not arg.startswith("-") else arg
        if _url_password(value) is not None:
            out.append(arg.replace(value, _redact_url(value)))
            continue
        out.append(arg)
    return out


def secret_values(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret strings in ``argv`` (what :func:`redact_argv` hides) and in the secret environment variables."""
    found: list[str] = []
    for before, after in zip(["", *argv], argv):
        flag, eq, value = after.partition("=")
        if before in SECRET_FLAGS and not before.count("="):
            found.append(after)
        elif flag in SECRET_FLAGS and eq:
            found.append(value)
        elif _secret_override(after):
            found.append(value)
        else:
            password = _url_password(value if "=" in after and not after.startswith("-") else after)
            if password:
                found.append(password)
    env = os.environ if environ is None else environ
    for name in SECRET_ENV:
        found += [v.strip() for v in (env.get(name) or "").split(",") if v.strip()]
    return sorted({v for v in found if v}, key=len, reverse=True)  # longest first: a prefix never hides the rest


class RedactingFilter(logging.Filter):
    """Replaces each secret value in a record's message (arguments merged in) with ``***``."""

    def __init__(self, values: Iterable[str]) -> None:
        super().__init__()
        self.values = sorted({v for v in values if v}, key=len, reverse=True)

    def add(self, *values: str) -> None:
        self.values = sorted({*self.values, *(v for v in values if v)}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.values:
            message = record.getMessage()
            redacted = self.redact(message)
            if redacted != message:
                record.msg, record.args = redacted, ()
            if record.exc_info and record.exc_text is None and record.exc_info[1] is not None:
                record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
            elif record.exc_text:
                record.exc_text = self.redact(record.exc_text)
        return True


def install_redaction(values: Iterable[str], level: int = logging.INFO) -> RedactingFilter:
    """A :class:`RedactingFilter` on every handler of the root logger (a basic stderr handler is added first when
    there is none: without one Python's last-resort handler would print records unfiltered)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    filt = RedactingFilter(values)
    for handler in root.handlers:
        handler.addFilter(filt)
    return filt
