"""Optional API keys: `Authorization: Bearer <key>`, keys from an environment variable or a file."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from pipeline.serve.errors import APIError

logger = logging.getLogger(__name__)


def load_api_keys(env_var: str | None, key_file: str | None) -> frozenset[str]:
    """The accepted keys: comma-separated in `env_var`, plus one per line in `key_file`.

    No keys at all means the server is open. A named file that does not exist is an error (a
    typo must not silently turn authentication off).
    """
    keys: set[str] = set()
    if env_var:
        keys.update(k.strip() for k in os.environ.get(env_var, "").split(",") if k.strip())
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"API key file {path} does not exist")
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.add(line)
    logger.info("API keys: %s", f"{len(keys)} accepted" if keys else "none (open server)")
    return frozenset(keys)


def check_api_key(authorization: str | None, keys: frozenset[str]) -> None:
    """Raise a 401 APIError unless `authorization` is `Bearer <one of keys>` (or keys is empty)."""
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="missing_api_key",
        )
    # Compare against every key in constant time so timing says nothing about near misses.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if not matched:
        raise APIError(
            401, "incorrect API key provided", type="authentication_error", code="invalid_api_key"
        )
