"""API keys and the tenants they belong to (the keys file), read with the standard library alone so the
CLI checks a keys file before anything heavy loads. See `tenants` for what a tenant may see."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHARED = ""  # the operator's namespace: the store itself, readable by every tenant

ROLES = ("ingest", "admin")


@dataclass(frozen=True)
class Tenant:
    name: str  # its namespace; SHARED ("") is the operator's corpus
    ingest: bool = False
    admin: bool = False


OPERATOR = Tenant(SHARED, ingest=True, admin=True)


def load_keys(path: str | Path) -> dict[str, Tenant]:
    """The keys file (see the module doc), checked whole: a bad entry is named."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"keys file {path}: cannot be read as JSON ({err})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"keys file {path}: must be a non-empty object of key -> {{tenant, roles}}")
    keys = {}
    for key, spec in raw.items():
        where = f"keys file {path}, key {key[:6]}...:"
        if len(key) < 16 or not key.isprintable():
            raise ValueError(f"{where} a key must be at least 16 printable characters")
        if not isinstance(spec, dict) or not isinstance(spec.get("tenant"), str):
            raise ValueError(f"{where} needs {{\"tenant\": \"name\", \"roles\": [...]}}")
        name, roles = spec["tenant"], spec.get("roles", [])
        if not name or len(name) > 64 or not name.isprintable():
            raise ValueError(f"{where} the tenant name must be 1-64 printable characters")
        if not isinstance(roles, list) or any(r not in ROLES for r in roles):
            raise ValueError(f"{where} roles must be a list drawn from {', '.join(ROLES)}")
        admin = "admin" in roles
        keys[key] = Tenant(SHARED if admin else name, ingest=admin or "ingest" in roles, admin=admin)
    return keys
