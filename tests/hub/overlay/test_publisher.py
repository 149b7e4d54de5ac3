"""The hub's signing key on disk: made once, kept, and readable by its owner only."""

from __future__ import annotations

import stat

from echo2p2p.hub.overlay.publisher import load_or_make_key


def test_the_key_is_made_0600_and_an_existing_one_is_made_0600(tmp_path):
    """A new key file is mode 0600; one found readable by others is made 0600, key unchanged."""
    path = tmp_path / "hub_key"
    key = load_or_make_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert load_or_make_key(path) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
