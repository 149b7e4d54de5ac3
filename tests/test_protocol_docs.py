"""The protocol pages hold to the code: fields, bounds, state tables and test vectors.

Everything is read out of docs/protocol/ as a reader sees it and compared with the code, so a
field added to a message without a changelog line, a bound moved in `echo2p2p.bounds` but not on
the page, a transition added to a state table on one side only, or a vector off by one byte
fails here. The bounds rows are not compared as text: each is turned into probes at and just
past the bound, which `bounds.check_from_peer` must accept and refuse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
import types
import typing
from pathlib import Path

import msgpack
import pytest
import zstandard

from echo2p2p import bounds, delta, frames, signing, snapshot
from echo2p2p import messages as m
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.overlay import link
from echo2p2p.session import TRANSITIONS, State

DOCS = Path(__file__).resolve().parents[1] / "docs" / "protocol"
PAGES = {p.stem: p.read_text() for p in DOCS.glob("*.md")}
HUB_SEED, PEER_SEED = bytes(range(32)), bytes(range(32, 64))  # signing.md section 11's keys


# --- reading the pages ---------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (`\\|` inside a cell is a literal bar)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _table_after(text: str, marker: str) -> list[list[str]]:
    """The body rows of the first table after `marker`."""
    start = text.index(marker)
    rows, started = [], False
    for line in text[start:].splitlines():
        if line.startswith("|"):
            started = True
            rows.append(_cells(line))
        elif started:
            break
    return [r for r in rows[2:]]  # header and separator


def _ticks(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _hex_after(text: str, label: str, nth: int = 0) -> bytes:
    """The bytes of the `nth` fenced hex block after `label`."""
    blocks = re.findall(r"```\n([0-9a-f \n]+?)\n```", text[text.index(label):])
    return bytes.fromhex(blocks[nth].replace("\n", " "))


# --- the field list of changes.md ----------------------------------------------------------


def _type_name(t: typing.Any) -> str:
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(t) if a is not type(None)]
        return f"{_type_name(inner)} | nil"
    if origin is list:
        return f"list[{_type_name(typing.get_args(t)[0])}]"
    return getattr(t, "TYPE", None) or t.__name__  # a message nested in another: its tag


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None or isinstance(value, bool):
        return " = " + {None: "nil", True: "true", False: "false"}[value]
    return " = " + ("[]" if value == [] else repr(value).replace("'", '"'))


def field_list() -> list[str]:
    """Every field of every message, nested record and link frame, as changes.md lists them."""
    lines: list[str] = []
    seen: set[type] = set(m.MESSAGE_TYPES.values())

    def walk(registry: dict[str, type], prefix: str) -> None:
        nested: list[type] = []
        for label, cls in [(prefix + tag, c) for tag, c in registry.items()]:
            hints = typing.get_type_hints(cls)
            fields = dataclasses.fields(cls)
            lines.extend([f"{label}.{f.name} {_type_name(hints[f.name])}{_default(f)}"
                          for f in fields] or [f"{label} (no fields)"])
            stack = [hints[f.name] for f in fields]
            while stack:
                t = stack.pop(0)
                if dataclasses.is_dataclass(t) and t not in seen:
                    seen.add(t)
                    nested.append(t)
                stack.extend(typing.get_args(t))
        if nested:
            walk({c.__name__: c for c in nested}, "")

    walk(m.MESSAGE_TYPES, "")
    walk(dict(link.FRAMES), "link ")
    for where, values in (("hello.engine", m.ENGINES), ("Sample.finish_reason", m.FINISH_REASONS),
                          ("relay_report.reason", m.RELAY_FAULTS)):
        lines.append(f"{where} one of {', '.join(values)}")
    return lines


def test_changes_lists_the_fields_of_the_code():
    """changes.md ends with every field (name, type, default) and closed set of the code: a
    field changed in echo2p2p.messages or echo2p2p.overlay.link without this page fails."""
    page = PAGES["changes"]
    block = re.search(r"<!-- fields:[^>]*-->\n```\n(.*?)\n```", page, re.S)
    assert block, "changes.md lost its field list"
    documented, code = block.group(1).splitlines(), field_list()
    added = [line for line in code if line not in documented]
    dropped = [line for line in documented if line not in code]
    assert not added and not dropped, (
        f"the wire changed (in the code, not on the page: {added}; on the page, not in the "
        f"code: {dropped}): add an entry to docs/protocol/changes.md and update its field list")
    assert documented == code, "changes.md lists the fields in another order than the code"


def test_changes_has_an_entry_for_every_version():
    """Every version from 1 to the one this code speaks has its section in changes.md."""
    newest = max(getattr(frames, "SUPPORTED_PROTOCOLS", ()), default=frames.PROTOCOL_VERSION)
    headed = {int(v) for v in re.findall(r"^## Protocol (\d+)", PAGES["changes"], re.M)}
    assert set(range(1, max(newest, frames.PROTOCOL_VERSION) + 1)) <= headed, headed


# --- message tables ------------------------------------------------------------------------

# The nested records with a table of their own, and where it starts.
RECORD_TABLES = {m.Sample: ("wire", "`Sample` (nested map):"),
                 m.SourceRate: ("wire", "`SourceRate` (nested map):"),
                 m.Manifest: ("overlay", "### Manifest (nested map)"),
                 m.GossipPlan: ("overlay", "### The announcement")}
DEFAULT_WORDS = {"nil": None, "false": False, "true": True}


def _documented_default(notes: str, f: dataclasses.Field) -> None:
    said = re.search(r"default `?([^`;:,)]+?)`?(?:[;:,)]|$)", notes)
    if said is None:
        return
    word = said.group(1).strip()
    code = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if word in ("empty", '""'):
        assert code in ("", b"", []), f.name
    elif word in DEFAULT_WORDS:
        assert code is DEFAULT_WORDS[word], f.name
    else:
        assert float(word.replace("−", "-")) == code, f.name


def _check_table(cls: type, rows: list[list[str]], check_types: bool) -> None:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    named = [(_ticks(r[0]) or [""])[0] for r in rows]
    assert sorted(named) == sorted(fields), f"{cls.__name__}: the page lists {named}"
    for row, name in zip(rows, named):
        f = fields[name]
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert ("*optional*" in row[2]) == optional, f"{cls.__name__}.{name}: optional?"
        if optional:
            _documented_default(row[2], f)
        if check_types:
            assert row[1] == _type_name(hints[name]).replace("relay_plan", "RelayPlan"), (
                f"{cls.__name__}.{name}: the page says {row[1]}")


@pytest.mark.parametrize("tag", sorted(m.MESSAGE_TYPES))
def test_message_tables_match_the_fields(tag):
    """Each message's table in wire.md section 3 names its fields, their types, which are
    optional and their defaults, as echo2p2p.messages declares them."""
    cls = m.MESSAGE_TYPES[tag]
    heading = re.search(rf"^### `{tag}` \(.*$", PAGES["wire"], re.M)
    assert heading, f"wire.md has no section for {tag}"
    if not dataclasses.fields(cls):
        assert "no fields" in heading.group(0)
        return
    _check_table(cls, _table_after(PAGES["wire"], heading.group(0)), check_types=True)


@pytest.mark.parametrize("cls", list(RECORD_TABLES), ids=lambda c: c.__name__)
def test_record_tables_match_the_fields(cls):
    """The nested records' tables (Sample, SourceRate, Manifest, the gossip plan) too."""
    page, marker = RECORD_TABLES[cls]
    _check_table(cls, _table_after(PAGES[page], marker), check_types=page == "wire")


def test_link_frame_table_names_every_frame_and_field():
    """overlay.md section 7a's frame table has one row per link frame, naming its fields."""
    rows = _table_after(PAGES["overlay"], "| `t` | fields | meaning |")
    documented = {_ticks(r[0])[0]: r[1] for r in rows}
    assert set(documented) == set(link.FRAMES)
    for tag, cls in link.FRAMES.items():
        for f in dataclasses.fields(cls):
            named = f.name in _ticks(documented[tag]) or (
                f.name in ("version", "base") and documented[tag].startswith("key"))
            assert named, f"link {tag}.{f.name} is not in overlay.md's frame table"


# --- state tables --------------------------------------------------------------------------


def _expand(rows: list[list[str]], states: list[str]) -> dict[tuple[str, str, str], str]:
    """(state, way, type) -> next state, from rows `state | event | next`."""
    out = {}
    for state_cell, event, nxt in rows:
        first = _ticks(state_cell)
        which = [s for s in states if s != "CLOSED"] if state_cell.startswith("any but") else first[:1]
        ways = [w for w, word in (("send", "send"), ("recv", "receive")) if word in event]
        for state in which:
            for way in ways:
                for tag in _ticks(event):
                    out[(state, way, tag)] = _ticks(nxt)[0]
    return out


@pytest.mark.parametrize("side", ["hub", "peer"])
def test_session_state_table_is_the_codes(side):
    """wire.md section 4's state table of each side is echo2p2p.session.TRANSITIONS, both ways:
    every row the code has is on the page, and nothing else."""
    rows = _table_after(PAGES["wire"], f"<!-- states: {side} -->")
    documented = _expand(rows, [s.name for s in State])
    code = {(state.name, way, cls.TYPE): nxt.name
            for (s, state, way, cls), nxt in TRANSITIONS.items() if s.value == side}
    assert documented == code


def test_link_state_table_is_the_codes():
    """overlay.md section 7a's link states are echo2p2p.overlay.link.LINK_TRANSITIONS."""
    rows = _table_after(PAGES["overlay"], "<!-- states: link -->")
    documented = {(_ticks(state)[0], tag): _ticks(nxt)[0]
                  for state, event, nxt in rows for tag in _ticks(event)}
    assert documented == link.LINK_TRANSITIONS


# --- value bounds --------------------------------------------------------------------------

WELCOME = m.Welcome("p1", "r1", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7)
UNBOUNDED = {("Sample", "text"), ("Sample", "turns")}  # a hint the hub re-decodes; episodes


def _sample(n_tokens: int = 2, logprob: float = -0.5, **kw) -> m.Sample:
    return m.Sample(m.pack_ids([5] * n_tokens), m.pack_logprobs([logprob] * n_tokens), "x",
                    kw.pop("reward", 0.0), kw.pop("finish_reason", "stop"), **kw)


BASE = {
    "hello": m.Hello("a", "transformers", "cpu"),
    "lease_request": m.LeaseRequest(1),
    "rollout": m.RolloutSubmission("L0", 0, [_sample(), _sample()]),
    "version_held": m.VersionHeld(0),
    "transfer_report": m.TransferReport(1, None, 1.0, 0, 0, [m.SourceRate("p2", 1, 1.0)]),
    "relay_report": m.RelayReport(1, "p2", "corrupt"),
    "goodbye": m.Goodbye(1000, "bye"),
}
NESTED = {"Sample": ("rollout", "samples"), "SourceRate": ("transfer_report", "sources")}


def _with(record: str, field: str, value) -> m.Message:
    """The valid message of `record` (or the one it nests in) with `field` set to `value`."""
    if record in NESTED:
        outer, attr = NESTED[record]
        msg = BASE[outer]
        inner = [value if isinstance(value, m.Sample) else
                 dataclasses.replace(x, **{field: value}) for x in getattr(msg, attr)]
        return dataclasses.replace(msg, **{attr: inner})
    return dataclasses.replace(BASE[record], **{field: value})


def _accepts(msg: m.Message) -> bool:
    try:
        bounds.check_from_peer(msg, WELCOME)
    except RemoteProtocolError:
        return False
    return True


def _number(text: str) -> float:
    """'2³¹ − 1', '2⁴⁸', '−1', '86 400' as a number."""
    sup = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
    text = text.replace("−", "-").replace(" ", "").replace("−", "-")
    power = re.fullmatch(r"2([⁰¹²³⁴⁵⁶⁷⁸⁹]+)([-+]\d+)?", text)
    if power:
        return 2 ** int(power.group(1).translate(sup)) + int(power.group(2) or 0)
    if (tens := re.fullmatch(r"10([⁰¹²³⁴⁵⁶⁷⁸⁹]+)", text)):
        return 10.0 ** int(tens.group(1).translate(sup))
    return float(text)


def _probes(record: str, field: str, bound: str) -> list[tuple[object, bool]]:
    """(value, accepted?) pairs at and past the bound a row states."""
    core = re.sub(r"\s*\(.*\)$", "", bound)
    if (chars := re.fullmatch(r"≤ (\d+) characters", core)):
        n = int(chars.group(1))
        return [("a" * n, True), ("a" * (n + 1), False), ("a\nb", False)]
    if (span := re.fullmatch(r"(?:finite, )?in \[(.+), (.+)\]", core)):
        lo, hi = map(_number, span.groups())
        return [(lo, True), (hi, True), (lo - 1, False), (hi * 1.01 + 1, False),
                (math.nan, False)]
    if (span := re.fullmatch(r"(\S+(?: − \d)?) to (\S+(?: − \d)?)", core)):
        lo, hi = (int(_number(x)) for x in span.groups())
        nil = [(None, True)] if f"`{field}` may be nil" in bound else []
        return [(lo, True), (hi, True), (lo - 1, False), (hi + 1, False), *nil]
    if (nbytes := re.fullmatch(r"empty, or (\d+)(?: to (\d+))? bytes", core)):
        lo = int(nbytes.group(1))
        hi = int(nbytes.group(2) or lo)
        return [(b"", True), (b"k" * lo, True), (b"k" * hi, True), (b"k" * (lo - 1), False),
                (b"k" * (hi + 1), False)]
    if re.fullmatch(r"(`[^`]+`(, | or )?)+", core):
        return [(v, True) for v in _ticks(core)] + [("other", False)]
    return []


SPECIAL = {  # rows whose bound is prose: probes written out here from the page's words
    ("hello", "listen_addr"): [(None, True), ("http://h:1", True), ("https://h:1/x", True),
                               ("http://h", False), ("http://h:0", False), ("ftp://h:1", False),
                               ("http://u@h:1", False), ("http://h:1?q", False),
                               ("http://h:1/" + "a" * 250, False)],
    ("hello", "features"): [([], True), (["a" * 32] * 32, True), (["a"] * 33, False),
                            (["a" * 33], False), ([""], False)],
    ("transfer_report", "sources"): [([m.SourceRate("p2", 1, 1.0)] * 1024, True),
                                     ([m.SourceRate("p2", 1, 1.0)] * 1025, False)],
    ("rollout", "samples"): [([_sample()] * 2, True), ([_sample()] * 3, False),
                             ([_sample()], False)],
    # whole samples: 1 to max_new_tokens (4) tokens, ids and logprobs of equal length
    ("Sample", "token_ids"): [(_sample(1), True), (_sample(4), True), (_sample(0), False),
                              (_sample(5), False),
                              (dataclasses.replace(_sample(2), token_ids=b"\x05" * 7), False)],
    ("Sample", "logprobs"): [(m.pack_logprobs([-0.5, 0.0009]), True),
                             (m.pack_logprobs([-0.5, 0.002]), False),
                             (m.pack_logprobs([-0.5, math.inf]), False)],
    ("Sample", "reward"): [(1e6, True), (-1e6, True), (1.0001e6, False), (math.nan, False)],
}
CLOSED_SETS = {("hello", "engine"): m.ENGINES, ("Sample", "finish_reason"): m.FINISH_REASONS,
               ("relay_report", "reason"): m.RELAY_FAULTS}


def _bounds_rows() -> list[tuple[str, str, str]]:
    rows, record = [], ""
    for first, fields, bound in _table_after(PAGES["wire"], "### Value bounds checked by the hub"):
        record = _ticks(first)[0] if first else record
        rows += [(record, field, bound) for field in _ticks(fields)]
    return rows


def test_bounds_table_covers_every_field_a_peer_sends():
    """wire.md section 12 has a bound for every field of every message a peer sends."""
    peer_sends = {cls for (side, _, way, cls) in TRANSITIONS if side.value == "peer" and way == "send"}
    records = {cls.TYPE: cls for cls in peer_sends} | {"Sample": m.Sample, "SourceRate": m.SourceRate}
    every = {(name, f.name) for name, cls in records.items() for f in dataclasses.fields(cls)}
    assert {(r, f) for r, f, _ in _bounds_rows()} == every - UNBOUNDED


@pytest.mark.parametrize("row", _bounds_rows(), ids=lambda r: f"{r[0]}.{r[1]}")
def test_bounds_table_is_what_the_hub_checks(row):
    """Each bound on the page, probed at and just past it: the hub accepts the one and refuses
    the other (echo2p2p.bounds), and a closed set lists exactly the code's values."""
    record, field, bound = row
    probes = SPECIAL.get((record, field)) or _probes(record, field, bound)
    assert probes, f"no probe for the bound {bound!r} of {record}.{field}"
    for value, accepted in probes:
        assert _accepts(_with(record, field, value)) is accepted, (record, field, value)
    if (record, field) in CLOSED_SETS:
        assert tuple(_ticks(bound)) == CLOSED_SETS[(record, field)]


# --- test vectors (vectors.md) -------------------------------------------------------------

VECTORS = PAGES["vectors"]


def _bf16(values: list[float]) -> bytes:
    """bfloat16 bit patterns (the high halves of float32s; these values are exact)."""
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def test_full_chunk_vector():
    """The full chunk: the page's raw stream is the stated tensor, and the code cuts, compresses
    and hashes it to the page's wire bytes and digests."""
    raw = _hex_after(VECTORS, "The raw stream")
    wire = _hex_after(VECTORS, "Chunk 0 on the wire")
    assert raw == _bf16([1.0, -2.0, 0.5, 0.0])
    manifest, wires = snapshot.build_snapshot(7, [("w", "bfloat16", [4], raw)], chunk_bytes=8)
    assert wires == [wire]
    assert f"`wire_bytes` {len(wire)}" in VECTORS
    assert zstandard.ZstdDecompressor().decompress(wire) == raw
    assert manifest.chunks[0].digest == _hex_after(VECTORS, "`ChunkEntry.digest`")
    assert snapshot.chunk_digest(wire) == manifest.chunks[0].digest
    assert manifest.digest == _hex_after(VECTORS, "the manifest's `digest`")
    assert hashlib.blake2b(raw, digest_size=32).digest() == manifest.digest


@pytest.mark.parametrize("codec", delta.CODECS)
def test_delta_vector(codec):
    """Each codec's delta: the page's chunk decodes to the page's new range, its frame inflates
    to the page's payload, and the code's encoder writes the page's bytes."""
    base = _hex_after(VECTORS, "Base (1.0")
    new = _hex_after(VECTORS, "New: word 1")
    assert base == _bf16([1.0, 2.0, 3.0, 4.0, 0.5, -1.0, 0.0, 8.0])
    section = f"#### `{codec}`"
    header, frame, inflated = (_hex_after(VECTORS, section, i) for i in range(3))
    magic, codec_id, word, stream, payload = struct.unpack("<4sBBxxQQ", header)
    assert (magic, codec_id, word, stream, payload) == (
        b"E2D1", delta.CODECS.index(codec), 2, len(new), len(frame))
    assert delta.decode(header + frame, base) == new
    assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=1 << 16) == inflated
    ours = delta.encode(new, base, word_bytes=2, codec=codec)
    assert zstandard.ZstdDecompressor().decompress(ours[24:], max_output_size=1 << 16) == inflated
    assert ours == header + frame


def _link_records() -> dict[str, typing.Any]:
    """The frames vectors.md describes, built from its words."""
    key = signing.public_key(PEER_SEED)
    ticket = signing.sign_ticket(HUB_SEED, "r1", "p1", key)
    chunk = _hex_after(VECTORS, "Chunk 0 on the wire")
    return {
        "have": link.Have(5, 4, bytes([0x0B]), b"\x11" * 32),
        "had": link.Had(5, 4, m.pack_ids([2])),
        "want": link.Want(5, 4, 3),
        "piece": link.Piece(7, None, 0, chunk),
        "cancel": link.Cancel(5, 4, 3),
        "peers": link.Peers([link.Neighbour("p1", "http://10.0.0.1:7000", key, ticket)]),
    }


@pytest.mark.parametrize("tag", ["have", "had", "want", "piece", "cancel", "peers"])
def test_link_frame_vector(tag):
    """Each link frame on the page is the code's encoding of the frame it describes, and the
    code decodes it back to that frame."""
    rec = _link_records()[tag]
    documented = _hex_after(VECTORS, f"#### `{tag}`")
    assert re.search(rf"#### `{tag}`\n\n[^\n]*(?:\n[^\n]+)*, {len(documented)} bytes:", VECTORS)
    layout = {"p": 2, "t": tag, **frames.to_wire(rec)}  # section 1's layout, fields in order
    assert msgpack.packb(layout, use_bin_type=True) == documented
    encoded = frames.encode_frame(tag, rec)
    if msgpack.unpackb(encoded)["p"] == 2:
        assert encoded == documented
    assert frames.decode_frame(documented, link.LINK_LIMITS, link.FRAMES)[0] == rec


def test_proof_frame_vector():
    """The proof: the page's prefix, then the ticket header made of section 11's vectors."""
    key = signing.public_key(PEER_SEED)
    header = ".".join(["p1", key.hex(), signing.sign_ticket(HUB_SEED, "r1", "p1", key).hex(),
                       signing.chunk_auth(PEER_SEED, "r1", "p2").hex()]).encode()
    prefix = _hex_after(VECTORS, "#### `proof`")
    said = re.search(r"\((\d+) bytes\), so the frame\s+is these (\d+) bytes followed by the "
                     r"header's, (\d+) bytes in all", VECTORS)
    assert said and [int(x) for x in said.groups()] == [len(header), len(prefix),
                                                         len(prefix) + len(header)]
    rec = link.Proof(header)
    assert msgpack.packb({"p": 2, "t": "proof", **frames.to_wire(rec)},
                         use_bin_type=True) == prefix + header
    assert frames.decode_frame(prefix + header, link.LINK_LIMITS, link.FRAMES)[0] == rec


def test_welcome_task_names_every_task_kind():
    """welcome.task's row names every kind a hub sends: the verifiers peers have, `custom`, and
    the `rg:` and `env:` families (a peer that refused an unlisted kind could not join)."""
    from echo2p2p.adapters import environment_task as environment
    from echo2p2p.tasks import REWARDS, reasoning, records

    row = next(r for r in _table_after(PAGES["wire"], "### `welcome`") if r[0] == "`task`")
    kinds = set(_ticks(row[2]))
    expected = {f'"{k}"' for k in REWARDS} | {f'"{records.KIND}"'} | {
        f'"{prefix}<name>"' for prefix in (reasoning.KIND_PREFIX, environment.KIND_PREFIX)}
    assert expected <= kinds, expected - kinds
