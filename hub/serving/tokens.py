"""Join tokens: who may join a hub. `echo2-hub token create|list|revoke`, `serve --tokens FILE`.

A token is `<id>.<secret>`. The file keeps, per token, its id, a name, when it was made and
revoked, and the SHA-256 of the secret, never the secret itself: whoever reads the file cannot
join with it. The file is rewritten atomically (a temporary file, then a rename) with mode 0600,
and a running hub re-reads it when it changes, so a revocation takes effect without a restart
(connected peers holding a revoked token are sent away at their next heartbeat).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from pathlib import Path

log = logging.getLogger("echo2p2p.hub.serving.server")  # reported with the hub's peer-facing side


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenBook:
    """The token file, read lazily and again whenever its modification time changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: dict[str, dict] = {}

    def _load(self) -> dict[str, dict]:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_ino, st.st_size)  # every save is a new inode
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            entries = json.loads(self.path.read_text()) if stamp is not None else []
            self._tokens, self._stamp = {e["id"]: e for e in entries}, stamp
        return self._tokens

    def _save(self, tokens: dict[str, dict]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(list(tokens.values()), out, indent=1)
        os.replace(tmp, self.path)
        self._stamp = None  # read it back next time

    def create(self, name: str = "") -> str:
        """A new token, returned once: only its hash is kept."""
        tokens = dict(self._load())
        token_id = secrets.token_hex(4)
        while token_id in tokens:
            token_id = secrets.token_hex(4)
        secret = secrets.token_urlsafe(24)
        tokens[token_id] = {"id": token_id, "name": name, "sha256": _digest(secret),
                            "created": round(time.time()), "revoked": None}
        self._save(tokens)
        return f"{token_id}.{secret}"

    def entries(self) -> list[dict]:
        """Every token's id, name, created and revoked times (no hashes)."""
        return [{k: v for k, v in e.items() if k != "sha256"} for e in self._load().values()]

    def revoke(self, token_id: str) -> bool:
        """Revoke `token_id`; False if there is no such token (revoking twice is fine)."""
        tokens = dict(self._load())
        if token_id not in tokens:
            return False
        if tokens[token_id]["revoked"] is None:
            tokens[token_id] = {**tokens[token_id], "revoked": round(time.time())}
            self._save(tokens)
        return True

    def refusal(self, token: str) -> str | None:
        """Why `token` may not join (a short reason safe to send back), or None if it may."""
        if not token:
            return "a join token is required (echo2-peer join URL --token ...)"
        token_id, _, secret = token.partition(".")
        entry = self._load().get(token_id)
        if entry is None or not hmac.compare_digest(entry["sha256"], _digest(secret)):
            return "join token not recognised"
        if entry["revoked"] is not None:
            return "join token revoked"
        return None


def join_refusal(book: TokenBook | None, token: str, joining: bool = True) -> str | None:
    """Why a peer with `token` may not be on a hub with token file `book`, or None (also when no
    token is required: `book` None). While the file cannot be read, new peers are refused
    (`joining`) and connected ones stay."""
    try:
        return book.refusal(token) if book is not None else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("cannot read the token file %s: %s", book.path, exc)
        return "the hub cannot check join tokens now" if joining else None
