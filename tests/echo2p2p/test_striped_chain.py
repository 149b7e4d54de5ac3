"""The striped chain: a ring in which every chunk starts at its owner and crosses every member."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import messages as m
from echo2p2p.relay import Broadcast, Member, owners_of, ring_of

FAST = settings(max_examples=60, deadline=None)


def _members(n: int, leaves: int = 0) -> list[Member]:
    return ([Member(f"s{i}", f"http://10.0.0.{i}:80") for i in range(n)]
            + [Member(f"leaf{i}", None) for i in range(leaves)])


def _sources(bc: Broadcast, peer_id: str) -> list[str | None]:
    """Whom `peer_id`'s own plan tells it to fetch each chunk from; None: the hub."""
    plan = bc.plan(peer_id)
    return [None if o == m.HUB_OWNER or plan.sources[o].peer_id == peer_id
            else plan.sources[o].peer_id for o in owners_of(plan)]


def _check_chains(bc: Broadcast, alive: list[str]) -> None:
    """Each chunk goes hub -> its owner -> ... through every member of `alive` once, every
    member feeds at most one child, and `source` says what the plans say."""
    ring = bc.ring()
    assert sorted(ring) == sorted(alive)
    sources = {p: _sources(bc, p) for p in ring}
    children = {p: {c for c in ring if any(s == p for s in sources[c])} for p in ring}
    assert all(len(kids) <= 1 for kids in children.values())
    for i in range(bc.n_chunks):
        owner = bc.owner(i)
        assert owner in ring and sources[owner][i] is None
        reached, at = [owner], owner
        while len(reached) < len(ring):
            at = next(c for c in ring if sources[c][i] == at)
            reached.append(at)
        assert sorted(reached) == sorted(ring)
        assert all(bc.source(p, i) == sources[p][i] for p in ring)


@FAST
@given(n=st.integers(1, 9), n_chunks=st.integers(1, 80), data=st.data())
def test_every_chunk_crosses_the_whole_ring_also_after_members_leave(n, n_chunks, data):
    """The first plans chain every chunk through every serving member; when members leave,
    the ring is spliced and their chunks get new first hops, and that still holds."""
    bc = Broadcast(1, None, n_chunks, strategy="striped-chain")
    bc.start(_members(n, leaves=2))
    alive = [f"s{i}" for i in range(n)]
    _check_chains(bc, alive)
    for victim in data.draw(st.permutations(alive))[:-1]:
        revision = bc.revision
        assert bc.drop(victim) is not None and bc.revision == revision + 1
        alive.remove(victim)
        _check_chains(bc, alive)


def test_each_member_fetches_its_own_stripes_from_the_hub_and_the_rest_from_one_parent():
    """With 4 members and 8 chunks, a member heads 2 stripes and takes 6 chunks from the
    member before it in the ring; each member uploads to exactly one other."""
    bc = Broadcast(1, None, 8, strategy="striped-chain")
    bc.start(_members(4))
    ring = bc.ring()
    for k, peer in enumerate(ring):
        got = Counter(_sources(bc, peer))
        assert got == {None: 2, ring[k - 1]: 6}


def test_leaves_and_late_joiners_pull_from_the_owners_and_are_not_in_the_ring():
    """A leaf, and a peer joining after the start, follow the owners' plan; dropping either
    changes nobody's plan."""
    bc = Broadcast(1, None, 12, strategy="striped-chain")
    bc.start(_members(3, leaves=1))
    bc.join(Member("late", "http://10.0.1.1:80"))
    assert "leaf0" not in bc.ring() and "late" not in bc.ring()
    for peer in ("leaf0", "late"):
        assert _sources(bc, peer) == [bc.owner(i) for i in range(12)]
    assert bc.drop("leaf0") is None and bc.drop("late") is None


def test_a_ring_member_that_owns_nothing_still_gets_its_child_a_new_parent():
    """With fewer chunks than members some own nothing; dropping one still re-plans."""
    bc = Broadcast(1, None, 2, strategy="striped-chain")
    bc.start(_members(4))
    idle = next(p for p in bc.ring() if p not in {bc.owner(0), bc.owner(1)})
    assert bc.drop(idle) is not None
    _check_chains(bc, [p for p in ("s0", "s1", "s2", "s3") if p != idle])


def test_other_strategies_share_one_plan():
    """For "pipelined", every member's plan is the shared one and there is no ring."""
    bc = Broadcast(1, None, 12)
    shared = bc.start(_members(3))
    assert bc.ring() == [] and all(bc.plan(f"s{i}") == shared for i in range(3))
    assert all(bc.source("s0", i) == (None if bc.owner(i) == "s0" else bc.owner(i))
               for i in range(12))


def test_a_slow_uplink_is_left_out_of_the_ring_and_pulls_from_the_first_hops():
    """Against a 20 Mbit/s hub, a member at 5 is a leaf: the ring is the fast ones, and it
    pulls each chunk from its first hop. So it is with no hub rate known, or a low one (a
    hub's rate measured over a chain is the pace the ring pulled at): the members' median
    upload counts too. Only with no rate measured at all is everyone in the ring."""
    members = [Member(f"s{i}", f"http://10.0.0.{i}:80", 20e6) for i in range(3)]
    members.append(Member("slow", "http://10.0.0.9:80", 5e6))
    bc = Broadcast(1, None, 12, strategy="striped-chain", hub_bps=20e6)
    bc.start(members)
    assert sorted(bc.ring()) == ["s0", "s1", "s2"]
    assert _sources(bc, "slow") == [bc.owner(i) for i in range(12)]
    _check_chains(bc, ["s0", "s1", "s2"])
    for hub_bps in (None, 4e6):
        unknown = Broadcast(1, None, 12, strategy="striped-chain", hub_bps=hub_bps)
        unknown.start(members)
        assert sorted(unknown.ring()) == ["s0", "s1", "s2"]
    assert len(ring_of([Member(mb.peer_id, mb.url) for mb in members], None)) == 4
    assert len(ring_of(members[2:], 20e6)) == 2  # never a ring of one


def test_a_departed_members_stripes_go_to_its_child():
    """A ring member that leaves hands its stripes to the next hop after it (whose want of
    them was out to the departed one, and fails): the others' wants, out to their parents
    already, still meet the chunks coming down the ring."""
    members = _members(5)
    bc = Broadcast(1, None, 20, strategy="striped-chain")
    bc.start(members)
    ring = bc.ring()
    gone, child = ring[1], ring[2]
    stripes = [i for i in range(20) if bc.owner(i) == gone]
    assert stripes and bc.drop(gone) is not None
    assert [bc.owner(i) for i in stripes] == [child] * len(stripes)
    _check_chains(bc, [p for p in ring if p != gone])
