"""The model-files index: canonical encoding, its signature, and the bounds a peer holds it to."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo2p2p import signing
from echo2p2p.errors import SnapshotError
from echo2p2p.model_index import (ALLOWED, MAX_FILE_BYTES, MAX_INDEX_BYTES, MAX_TOTAL_BYTES,
                                  encode_index, file_digest, index_digest, index_of, parse_index)

FILES = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b"\x00\x01tok"}


def test_an_index_round_trips_and_its_signature_verifies():
    """What the hub encodes, a peer parses back to the same files; the signature over its
    digest verifies with the hub's key and no other, and over no other digest."""
    data = encode_index(index_of("lab/model", FILES, {"eos_token_id": 1}))
    index = parse_index(data)
    assert index.model == "lab/model" and index.tokens == {"eos_token_id": 1}
    assert {(e.name, e.nbytes, e.digest) for e in index.files} == {
        (n, len(b), file_digest(b)) for n, b in FILES.items()}
    key = signing.new_private_key()
    digest = index_digest(data)
    sig = signing.sign_model_files(key, digest)
    assert signing.verify_model_files(signing.public_key(key), digest, sig)
    assert not signing.verify_model_files(signing.public_key(signing.new_private_key()), digest, sig)
    assert not signing.verify_model_files(signing.public_key(key), bytes(32), sig)
    # Canonical: the same files in another order encode to the same bytes.
    assert encode_index(index_of("lab/model", dict(reversed(FILES.items())),
                                 {"eos_token_id": 1})) == data


def _index(**changes) -> bytes:
    raw = index_of("m", FILES, {})
    files = raw["files"]
    for name, entry in changes.items():
        if entry is None:
            files.pop(name, None)
        else:
            files[name] = entry
    return json.dumps(raw).encode()


OK = {"bytes": 1, "digest": "a" * 64}


@pytest.mark.parametrize("data, why", [
    (b"\xff not json", "not JSON"),
    (b"[]", "JSON object"),
    (json.dumps({"model": "m", "hash_algo": "sha1", "files": {}}).encode(), "hash_algo"),
    (_index(**{"../../.bashrc": OK}), "not an allowed model file"),
    (_index(**{"model.safetensors": OK}), "not an allowed model file"),
    (_index(**{"tokenizer.json": {"bytes": MAX_FILE_BYTES + 1, "digest": "a" * 64}}), "size"),
    (_index(**{"tokenizer.json": {"bytes": -1, "digest": "a" * 64}}), "size"),
    (_index(**{"tokenizer.json": {"bytes": True, "digest": "a" * 64}}), "size"),
    (_index(**{"tokenizer.json": {"bytes": 3, "digest": "A" * 64}}), "digest"),
    (_index(**{"tokenizer.json": {"bytes": 3, "digest": "a" * 63}}), "digest"),
    (_index(**{"config.json": None}), "lacks config.json"),
    (_index(**{"tokenizer.json": None}), "tokenizer file"),
    (_index(**{n: {"bytes": MAX_TOTAL_BYTES // 3 + 1, "digest": "a" * 64}
               for n in ("tokenizer.json", "vocab.json", "merges.txt")}), "total"),
    (b" " * (MAX_INDEX_BYTES + 1), "over the"),
    (b"[" * 30_000 + b"]" * 30_000, "not JSON"),  # nested past the parser's recursion
])
def test_a_hostile_index_is_refused_with_its_reason(data, why):
    """Names outside the allowlist (paths, weights), sizes out of bounds, malformed digests,
    a missing config or tokenizer, a total or an index over its cap: SnapshotError saying which."""
    with pytest.raises(SnapshotError, match=why):
        parse_index(data)


def test_too_many_files_is_refused():
    """An index may list at most one entry per allowed name; a map with more is refused."""
    raw = index_of("m", FILES, {})
    raw["files"].update({f"x{i}": OK for i in range(len(ALLOWED))})
    with pytest.raises(SnapshotError, match="files, over"):
        parse_index(json.dumps(raw).encode())


@given(st.binary(max_size=2048))
def test_any_bytes_parse_or_fail_cleanly(data):
    """On any input, parse_index returns an index or raises SnapshotError, nothing else."""
    try:
        parse_index(data)
    except SnapshotError:
        pass
