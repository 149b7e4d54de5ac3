"""The hub's lease quotas (`hub.core.leasing.Quotas`) over a real lease book, trust guard and
peers (no sockets: a quota never touches one): what a grant weighs, what an expired lease
costs, what is forgotten when a connection leaves."""

from echo2p2p import messages as m
from echo2p2p.buffer import RolloutBuffer
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.core.actions import Outbox
from echo2p2p.hub.core.counters import Counters
from echo2p2p.hub.core.leasing import Quotas
from echo2p2p.hub.core.peer import Peer
from echo2p2p.hub.core.quarantine import TrustGuard
from echo2p2p.hub.serving.server import new_lease_id
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.lease_quota import LeaseQuota, QuotaPolicy
from echo2p2p.leases import LeaseBook, shuffled_epochs
from echo2p2p.staleness import lease_min_version
from echo2p2p.trust import TrustBook

CFG = HubConfig.from_flat(prompts_per_step=4, max_lag=2)  # budget 8


def conn(peer_id: str, remote: str = "10.0.0.1") -> Peer:
    return Peer(peer_id, m.Hello(peer_id, "transformers", "cpu"), HubProtocol(0.0, 1 << 20),
                Outbox(), remote=remote)


def rig(*conns: Peer, rates=lambda peer_id: 0.0,
        published=lambda: None) -> tuple[Quotas, LeaseBook, TrustBook]:
    leases = LeaseBook([f"q{i}" for i in range(20)], 10.0, shuffled_epochs(20, 0),
                       lease_ids=new_lease_id)
    trust = TrustBook()
    guard = TrustGuard(trust, leases, RolloutBuffer(CFG.staleness.max_lag), Counters(),
                       Outbox())
    peers = {c.peer_id: c for c in conns}
    return Quotas(CFG, peers, leases, guard, Counters(),
                  LeaseQuota(QuotaPolicy(start=CFG.staleness.new_peer_leases)), rates,
                  published), leases, trust


def grant_while_allowed(quotas: Quotas, leases: LeaseBook, c: Peer) -> int:
    n = 0
    while quotas.allows(c, leases.open_count) and n < 100:
        leases.grant(c.peer_id, 0.0, 0)
        n += 1
    return n


def test_a_new_peer_gets_its_start_and_an_address_shares_it():
    a, b, far = conn("p1"), conn("p2"), conn("p3", remote="10.9.9.9")
    quotas, leases, _ = rig(a, b, far)
    assert grant_while_allowed(quotas, leases, a) == 2
    assert grant_while_allowed(quotas, leases, b) == 0  # its address's new-peer share is taken
    assert grant_while_allowed(quotas, leases, far) == 2  # another address: the probation's rest


def test_hoarders_from_many_networks_leave_a_new_peer_its_start():
    """128 unproven hoarders, each from a /24 of its own, hold their start (256 leases, far
    past a batch); a new peer that comes after them still gets its own 2 at once."""
    hoarders = [conn(f"h{n}", remote=f"127.{n}.0.1") for n in range(1, 129)]
    honest = conn("p1", remote="127.0.0.1")
    quotas, leases, _ = rig(*hoarders, honest)
    assert sum(grant_while_allowed(quotas, leases, h) for h in hoarders) == 256
    assert grant_while_allowed(quotas, leases, honest) == 2


def test_a_proven_peer_gets_the_whole_budget_beside_hoarders():
    good, hoarder = conn("p1"), conn("p2", remote="10.9.9.9")
    quotas, leases, _ = rig(good, hoarder)
    for _ in range(20):
        quotas.book.delivered(good.identity, good.address_key)
    assert grant_while_allowed(quotas, leases, hoarder) == 2
    assert grant_while_allowed(quotas, leases, good) == 8  # the budget, none of it the hoarder's


def test_an_expiry_costs_an_unproven_peer_trust_and_a_proven_one_only_quota():
    """An unproven holder of a version pays trust; a proven one, and one still loading its
    first version (an honest peer downloading the model), pay quota only."""
    good, hoarder, loading = conn("p1"), conn("p2"), conn("p3")
    quotas, leases, trust = rig(good, hoarder, loading)
    for c in (good, hoarder):
        c.protocol.note_held(0, 0)
    for _ in range(5):
        quotas.book.delivered(good.identity, good.address_key)
    for c in (good, hoarder, loading):
        leases.grant(c.peer_id, 0.0, 0)
    quotas.expired(leases.expire(11.0))
    assert trust.events[hoarder.identity]["lease_expired"] == 1
    assert good.identity not in trust.events and loading.identity not in trust.events
    assert quotas.book.standing(good.identity).expired == 1
    assert quotas.book.standing(loading.identity).expired == 1
    assert quotas.counters.leases_expired == 3


def test_a_leaving_connection_is_forgotten_its_address_is_not():
    c = conn("p1")
    quotas, _, _ = rig(c)
    quotas.book.expired(c.identity, c.address_key)
    quotas.left(c)
    assert quotas.book.standing(c.identity).expired == 0
    assert quotas.book.standing(c.address_key).expired == 1


def test_a_slow_peer_holds_what_it_finishes_in_a_timeout_and_its_queued_leases_wait_their_turn():
    """Measured at 4 s a group (G = 8 at 2 completions/s) against a 10 s lease timeout: at most
    2 open leases; the second is due 4 s later than the first (its place in the queue)."""
    slow = conn("p1")
    cfg = HubConfig.from_flat(prompts_per_step=4, max_lag=2, group_size=8, lease_timeout_s=10.0)
    leases = LeaseBook([f"q{i}" for i in range(20)], 10.0, shuffled_epochs(20, 0))
    guard = TrustGuard(TrustBook(), leases, RolloutBuffer(2), Counters(),
                       Outbox())
    quotas = Quotas(cfg, {slow.peer_id: slow}, leases, guard, Counters(), LeaseQuota(),
                    rates=lambda peer_id: 2.0)
    for _ in range(20):
        quotas.book.delivered(slow.identity, slow.address_key)  # its standing allows plenty
    holdings, deadlines = quotas.holdings(), []
    while quotas.allows(slow, leases.open_count, holdings):
        wait_s, latest_s = quotas.wait_s(slow, holdings)
        deadlines.append(leases.grant(slow.peer_id, 0.0, 0, wait_s=wait_s, latest_s=latest_s).deadline)
        holdings.add(slow, quotas.book)
    assert deadlines == [10.0, 14.0]


def dated(quotas: Quotas, leases: LeaseBook, step: int, queued: int) -> int:
    """The min_version the core's dispatch pass (`HubCore`) gives a lease granted now, at learner `step` (not
    training) with `queued` groups in the buffer."""
    outstanding = leases.open_count + queued
    return lease_min_version(step, False, quotas.ahead(outstanding, quotas.holdings()),
                             CFG.grpo.prompts_per_step, max_lag=CFG.staleness.max_lag)


def test_a_resumed_hubs_orphans_do_not_date_a_lease_a_step_later():
    """S = 2, kappa = 3, resumed at v18 with 11 groups queued and one lease open: two steps
    later (step 20, v18 the newest published) 3 groups are queued and the orphan may never come
    (nobody holds it). A lease granted now must be one v18 can make: dated v19, it would wait for
    v21, which needs the step that waits for it (the resume hang)."""
    state = LeaseBook(["q"], 10.0, shuffled_epochs(1, 0)).state()
    book = {**state, "open": [["orphan-lease", 0, 16]], "drawn": 1}
    quotas, leases, _ = rig(conn("p1"), published=lambda: 18)
    leases.restore(book, 0.0)
    assert dated(quotas, leases, step=20, queued=3) == 18
    proven_peer = conn("p2")
    quotas.peers[proven_peer.peer_id] = proven_peer
    for _ in range(5):
        quotas.book.delivered(proven_peer.identity, proven_peer.address_key)
    leases.grant(proven_peer.peer_id, 0.0, 18)  # held, makeable with v18: it counts
    assert dated(quotas, leases, step=20, queued=3) == 19


def test_a_lease_waiting_for_an_unpublished_version_does_not_date_a_lease_a_step_later():
    """Step 20, v18 the newest published, 3 groups queued: a peer holds a lease dated v19 (it
    waits for v21). A lease granted now is dated v18, so the batch of step 20 can fill."""
    quotas, leases, _ = rig(conn("p1"), published=lambda: 18)
    holder = conn("p2")
    quotas.peers[holder.peer_id] = holder
    for _ in range(5):
        quotas.book.delivered(holder.identity, holder.address_key)
    leases.grant(holder.peer_id, 0.0, 19)
    assert dated(quotas, leases, step=20, queued=3) == 18


def test_a_full_budget_with_every_peer_proven_is_known_without_counting_holdings():
    """`full` says no lease may go anywhere only when the budget is used up and every connected
    peer is proven: an unproven one may still take its probation lease, a proven one a lease
    the budget frees (as `allows` would find, one peer at a time)."""
    good, new = conn("p1"), conn("p2", remote="10.9.9.9")
    quotas, leases, _ = rig(good, new)
    for _ in range(20):
        quotas.book.delivered(good.identity, good.address_key)
    assert grant_while_allowed(quotas, leases, new) == 2
    assert grant_while_allowed(quotas, leases, good) == 8
    assert not quotas.full(leases.open_count)  # `new` is unproven: its leases are on top
    quotas.book.delivered(new.identity, new.address_key)
    quotas.book.delivered(new.identity, new.address_key)
    assert quotas.full(leases.open_count) and not quotas.allows(good, leases.open_count)
    assert not quotas.full(quotas.budget - 1)


def test_an_unproven_peers_submissions_being_judged_count_against_its_cap():
    """A new peer that answers its leases at once, while its samples wait at the scorer, takes
    no more than its cap until they are judged (else it queued thousands); a proven peer's
    judged submissions are the budget's, not its cap's."""
    new, good = conn("p1"), conn("p2", remote="10.9.9.9")
    quotas, leases, _ = rig(new, good)
    for _ in range(20):
        quotas.book.delivered(good.identity, good.address_key)
    taken = []
    for _ in range(2):
        taken.append(leases.grant(new.peer_id, 0.0, 0))
    for lease in taken:
        leases.complete(lease.lease_id, new.peer_id)  # submitted: now being judged
    assert not quotas.allows(new, 2)
    leases.requeue(taken[0], "rejected")  # judged
    assert quotas.allows(new, 1)
    mine = leases.grant(good.peer_id, 0.0, 0)
    leases.complete(mine.lease_id, good.peer_id)
    judged = 2  # the new peer's one left, and this one: both in the hub's outstanding
    granted = 0
    while quotas.allows(good, leases.open_count + judged) and granted < 100:
        leases.grant(good.peer_id, 0.0, 0)
        granted += 1
    assert granted == 8 - 1  # the budget less its own judged one (the new peer's is on top)
