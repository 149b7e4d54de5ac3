"""The hub's record of how a version spread: reports believed only as far as they could be."""

from echo2p2p import messages as m
from echo2p2p.propagation import MIN_MEASURED_BYTES, Propagation, deciles

SIZE = 4 * MIN_MEASURED_BYTES


def report(*sources: tuple[str, int, float], from_peers: int = 0) -> m.TransferReport:
    return m.TransferReport(1, None, 2.0, SIZE, from_peers,
                            [m.SourceRate(peer, nbytes, span) for peer, nbytes, span in sources])


def test_sources_are_believed_only_within_the_manifest_and_the_expected_peers():
    """No self-sourcing, no stranger, no more than the manifest, no faster than any link,
    no source twice in one report; bytes from peers capped at the manifest."""
    prop = Propagation(1, 0.0, {"a", "b", "c"})
    prop.count("a", report(("a", SIZE, 1.0), ("x", SIZE, 1.0), ("b", SIZE + 1, 1.0),
                           ("c", SIZE, 1e-9), ("b", SIZE, 1.0), ("b", SIZE, 1.0),
                           from_peers=10 * SIZE), SIZE)
    assert prop.received == {"b": [(SIZE, 1.0)]}
    assert prop.bytes_from_peers == SIZE


def test_upload_is_what_receivers_got_over_their_median_span():
    prop = Propagation(1, 0.0, {"a", "b", "c", "d"})
    for receiver, span in (("a", 1.0), ("c", 2.0), ("d", 4.0)):
        prop.count(receiver, report(("b", SIZE // 2, span)), SIZE)
    prop.count("a", report(("c", 1000, 1.0)), SIZE)  # too little to say anything
    assert prop.upload_rates() == {"b": 8 * 3 * (SIZE // 2) / 2.0}


def test_an_even_count_of_spans_takes_the_shorter_middle_one():
    """Of two receivers, one that claims a span a million times too long (a liar, or a slow
    link of its own) does not slow the relay on paper: the shorter span counts."""
    prop = Propagation(1, 0.0, {"a", "b", "c"})
    prop.count("a", report(("b", SIZE, 1.0)), SIZE)
    prop.count("c", report(("b", SIZE, 1e6)), SIZE)
    assert prop.upload_rates() == {"b": 8 * 2 * SIZE / 1.0}


def test_one_liar_of_three_receivers_moves_the_median_by_one_place_only():
    """Receivers at 1, 2 and 4 s: a liar at 1e6 s in place of the 1 s one gives the 4 s span."""
    prop = Propagation(1, 0.0, {"a", "b", "c", "d"})
    for receiver, span in (("a", 1e6), ("c", 2.0), ("d", 4.0)):
        prop.count(receiver, report(("b", SIZE // 2, span)), SIZE)
    assert prop.upload_rates() == {"b": 8 * 3 * (SIZE // 2) / 4.0}


def test_the_record_says_how_far_and_how_fast_it_spread():
    prop = Propagation(3, 10.0, {"a", "b"}, on_delta=1)
    prop.done_after_s.update(a=1.5, b=2.25)
    prop.bytes_from_hub = SIZE // 2
    record = prop.record(SIZE, 100, complete=True)
    assert record["event"] == "propagation" and record["version"] == 3
    assert record["peers"] == 2 and record["peers_on_delta"] == 1 and record["complete"]
    assert (record["t50_s"], record["t100_s"], record["done_s"]) == (1.5, 2.25, 2.25)
    assert record["hub_upload_copies"] == 0.5 and record["delta_wire_bytes"] == 100
    assert prop.record(0, None, complete=False)["hub_upload_copies"] is None


def test_the_cdf_gives_the_seconds_until_each_tenth_of_the_peers_held_it():
    """Deciles of 4 peers of which 3 finished: 0 % at 0 s, 10-25 % at the first, 30-50 % at
    the second, 60-75 % at the third, never 80 % or more; as the 50/90/100 % are counted."""
    assert deciles([3.0, 1.0, 2.0], 4) == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, None, None, None]
    prop = Propagation(1, 0.0, {"a", "b", "c"}, predicted_bcast_s=4.5)
    prop.done_after_s.update(a=1.0, b=2.0, c=3.0)
    record = prop.record(SIZE, None, complete=True)
    assert record["cdf_s"][5] == record["t50_s"] == 2.0 and record["cdf_s"][10] == record["t100_s"]
    assert record["predicted_bcast_s"] == 4.5
