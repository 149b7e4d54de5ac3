"""Leases: grant, complete once, expire and re-issue, release on leave."""

from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p.leases import Completion, LeaseBook, shuffled_epochs


def book(n: int = 5, timeout_s: float = 10.0) -> LeaseBook[str]:
    problems = [f"q{i}" for i in range(n)]
    return LeaseBook(problems, timeout_s, shuffled_epochs(n, seed=0))


def test_shuffled_epochs_cover_every_problem_each_epoch():
    """Every epoch is a permutation."""
    it = shuffled_epochs(7, seed=3)
    for _ in range(3):
        assert sorted(next(it) for _ in range(7)) == list(range(7))


def test_submission_is_idempotent():
    """The first submission completes the lease; once admitted a second is a duplicate, never
    new; before the verdict it is told the first is being judged."""
    b = book()
    lease = b.grant("p1", now=0.0, min_version=0)
    assert b.complete(lease.lease_id, "p1") == (Completion.NEW, lease)
    assert b.complete(lease.lease_id, "p1") == (Completion.JUDGING, None)
    b.admitted(lease.lease_id)
    assert b.complete(lease.lease_id, "p1") == (Completion.DUPLICATE, None)
    assert b.verdict(lease.lease_id) == ""
    assert b.complete("L999", "p1") == (Completion.UNKNOWN, None)


def test_a_rejected_lease_is_rejected_again_for_the_same_reason():
    """A resubmission of a rejected lease hears that rejection, not "duplicate"."""
    b = book()
    lease = b.grant("p1", 0.0, 0)
    b.complete(lease.lease_id, "p1")
    b.requeue(lease, "bad_tokens")
    assert b.complete(lease.lease_id, "p1") == (Completion.REJECTED, None)
    assert b.verdict(lease.lease_id) == "bad_tokens"
    assert b.grant("p2", 1.0, 0).item == lease.item  # its prompt went back


def test_lease_of_another_peer_is_unknown():
    """A peer cannot complete a lease granted to someone else."""
    b = book()
    lease = b.grant("p1", 0.0, 0)
    assert b.complete(lease.lease_id, "p2")[0] is Completion.UNKNOWN
    assert b.complete(lease.lease_id, "p1")[0] is Completion.NEW


def test_other_peers_leases_are_unknown_whatever_became_of_them():
    """Judged, admitted, rejected or expired: to another peer each is what a lease id never
    granted is, so no peer learns of others' leases."""
    b = book(timeout_s=5.0)
    judging, admitted, rejected, expired = (b.grant("p1", 0.0, 0) for _ in range(4))
    for lease in (judging, admitted, rejected):
        b.complete(lease.lease_id, "p1")
    b.admitted(admitted.lease_id)
    b.requeue(rejected, "stale")
    b.expire(9.0)
    answers = {b.complete(lease.lease_id, "p2") for lease in (judging, admitted, rejected, expired)}
    assert answers == {(Completion.UNKNOWN, None)} == {b.complete("L12345", "p2")}
    assert [b.complete(lease.lease_id, "p1")[0] for lease in (judging, admitted, rejected, expired)] \
        == [Completion.JUDGING, Completion.DUPLICATE, Completion.REJECTED, Completion.EXPIRED]


def test_lease_ids_come_from_the_given_maker():
    ids = iter(["x9", "y7"])
    b = LeaseBook(["q0"], 10.0, shuffled_epochs(1, seed=0), lease_ids=lambda: next(ids))
    assert [b.grant("p1", 0.0, 0).lease_id for _ in range(2)] == ["x9", "y7"]


def test_a_lease_being_judged_is_checkpointed_as_open():
    """A hub resumed from a checkpoint taken while a rollout was judged has no verdict for it:
    the lease comes back open (an orphan), not lost and not done."""
    b = book()
    lease = b.grant("p1", 0.0, 0)
    b.complete(lease.lease_id, "p1")
    restored = book()
    restored.restore(b.state(), 1.0)
    assert restored.complete(lease.lease_id, "p9")[0] is Completion.NEW


def test_expired_lease_is_reissued_first():
    """An expired lease's problem is the next one granted; the late submission is refused."""
    b = book(timeout_s=5.0)
    lease = b.grant("p1", 0.0, 0)
    b.grant("p1", 1.0, 0)
    assert b.expire(5.5) == [lease]
    again = b.grant("p2", 6.0, 0)
    assert again.item == lease.item and again.lease_id != lease.lease_id
    assert b.complete(lease.lease_id, "p1")[0] is Completion.EXPIRED


def test_leaving_peer_returns_its_leases():
    """release_peer re-queues exactly that peer's open leases."""
    b = book()
    mine = [b.grant("p1", 0.0, 0) for _ in range(2)]
    other = b.grant("p2", 0.0, 0)
    assert sorted(l.lease_id for l in b.release_peer("p1")) == sorted(l.lease_id for l in mine)
    assert b.open_count == 1
    assert {b.grant("p3", 1.0, 0).item for _ in range(2)} == {l.item for l in mine}
    assert b.complete(other.lease_id, "p2")[0] is Completion.NEW


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["grant", "complete", "expire", "leave"]),
                          st.integers(0, 2)), max_size=60))
def test_no_problem_is_lost(ops):
    """Every problem handed out is open, pending or completed: none vanishes."""
    b = book(n=4, timeout_s=3.0)
    now, handed, completed = 0.0, [], []
    for op, who in ops:
        now += 1.0
        peer = f"p{who}"
        if op == "grant":
            handed.append(b.grant(peer, now, 0))
        elif op == "complete" and handed:
            lease = handed[-1]
            status, got = b.complete(lease.lease_id, lease.peer_id)
            if status is Completion.NEW:
                completed.append(got.item)
        elif op == "expire":
            b.expire(now)
        elif op == "leave":
            b.release_peer(peer)
    stats = b.statistics()
    assert stats.granted_total == len(handed)
    # each grant ends in exactly one place: still open, completed, or back in the queue
    assert stats.granted_total == stats.open + stats.completed_total + stats.requeued_total
    assert stats.completed_total == len(completed)


@settings(max_examples=60)
@given(st.integers(0, 40), st.lists(st.tuples(
    st.sampled_from(["grant", "complete", "expire", "leave", "requeue"]), st.integers(0, 2)),
    max_size=60))
def test_checkpoint_plus_journal_restores_the_book(cut, ops):
    """A book restored from `state()` at any point plus the changes after it equals the book
    that never stopped; its open leases are orphans any peer may complete, once."""
    live, changes = book(n=4, timeout_s=3.0), []
    snapshot, now, handed = live.state(), 0.0, []
    for i, (op, who) in enumerate(ops):
        if i == cut:
            snapshot, changes = live.state(), []
        live.on_change = changes.append
        now += 1.0
        if op == "grant":
            handed.append(live.grant(f"p{who}", now, who))
        elif op == "complete" and handed:
            status, lease = live.complete(handed[-1].lease_id, handed[-1].peer_id)
            if status is Completion.NEW and who == 0:
                live.requeue(lease)
            elif status is Completion.NEW:
                live.admitted(lease.lease_id)
                changes.append(("done", lease.lease_id))  # what the hub journals on admission
        elif op == "expire":
            live.expire(now)
        elif op == "leave":
            live.release_peer(f"p{who}")
    restored = book(n=4, timeout_s=3.0)
    restored.restore(snapshot, now)
    for change in changes:
        restored.replay(change, now)
    assert restored.state() == live.state()
    for lease_id, _, _ in restored.state()["open"]:
        assert restored.complete(lease_id, "someone-new")[0] is Completion.NEW
        restored.admitted(lease_id)
        assert restored.complete(lease_id, "someone-new")[0] is Completion.DUPLICATE
        assert restored.complete(lease_id, "someone-else")[0] is Completion.UNKNOWN
    # the next problems drawn are the same: the data cursor survived
    assert [restored.grant("x", now, 0).item for _ in range(6)] == \
        [live.grant("x", now, 0).item for _ in range(6)]


def test_a_delivery_renews_its_peers_queued_leases_up_to_their_latest_and_no_one_elses():
    """Leases due 10 s after their grant (timeout 10): p1's delivery at 8 s moves its other
    leases to 18 s, not past the latest each was granted with; p2's lease is not renewed; with
    no delivery after, they expire at those deadlines."""
    book = LeaseBook(list(range(10)), 10.0, shuffled_epochs(10, 0))
    first = book.grant("p1", 0.0, 0)
    queued = book.grant("p1", 0.0, 0, wait_s=0.0, latest_s=30.0)
    capped = book.grant("p1", 0.0, 0, wait_s=0.0, latest_s=15.0)
    other = book.grant("p2", 0.0, 0, wait_s=0.0, latest_s=30.0)
    book.complete(first.lease_id, "p1")
    book.renew("p1", 8.0)
    due = {lease.lease_id: lease.deadline for lease in book.open_leases()}
    assert due == {queued.lease_id: 18.0, capped.lease_id: 15.0, other.lease_id: 10.0}
    assert {lease.lease_id for lease in book.expire(15.0)} == {capped.lease_id, other.lease_id}
    assert [lease.lease_id for lease in book.expire(18.0)] == [queued.lease_id]
