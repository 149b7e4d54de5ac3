"""Every message kind a peer sends has a rate (`echo2p2p.frame_budget`): a burst, then per_s;
past it frames are dropped, and a connection that keeps at it is closed. Pure, explicit `now`;
and through the hub's protocol, which turns the verdicts into events and a close."""

import pytest

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p.errors import Flooding
from echo2p2p.frame_budget import CLOSE, DROP, HUB_RATES, TAKE, FrameBudget, KindRate, worst
from echo2p2p.read_budget import ReadBudget

RATES = {"version_held": KindRate(per_s=2.0, burst=4)}


def test_a_burst_is_taken_then_frames_past_the_rate_are_dropped():
    budget = FrameBudget(0.0, RATES)
    assert [budget.spend("version_held", 0.0) for _ in range(5)] == [TAKE] * 4 + [DROP]
    assert budget.spend("version_held", 0.5) == TAKE  # half a second: one more token
    assert budget.statistics().dropped == {"version_held": 1}
    assert budget.statistics().taken == {"version_held": 5}


def test_a_kind_without_a_rate_is_always_taken():
    budget = FrameBudget(0.0, RATES)
    assert all(budget.spend("hello", 0.0) == TAKE for _ in range(1000))


def test_dropping_for_well_over_a_burst_closes():
    """Drops are a debt that leaks at the rate: one burst too many is forgiven, a flood is not."""
    budget = FrameBudget(0.0, RATES)
    verdicts = [budget.spend("version_held", 0.0) for _ in range(4 + 5)]
    assert verdicts == [TAKE] * 4 + [DROP] * 4 + [CLOSE]


def test_an_occasional_excess_is_forgiven_as_time_passes():
    """A peer a little over its rate, for long, has its excess dropped and is never closed:
    its debt leaks between bursts."""
    budget = FrameBudget(0.0, RATES)
    now, verdicts = 0.0, []
    for _ in range(200):  # 3 frames a second against a rate of 2, in bursts of 3
        verdicts += [budget.spend("version_held", now) for _ in range(3)]
        now += 1.0
    assert CLOSE not in verdicts and verdicts.count(DROP) > 100


def test_a_scaled_budget_holds_that_many_connections():
    budget = FrameBudget(0.0, RATES, scale=16)
    assert [budget.spend("version_held", 0.0) for _ in range(65)][-2:] == [TAKE, DROP]


def test_a_clock_that_steps_back_refills_nothing():
    budget = FrameBudget(10.0, RATES)
    for _ in range(4):
        budget.spend("version_held", 10.0)
    assert budget.spend("version_held", 5.0) == DROP


def test_the_worst_verdict_of_several_budgets_wins():
    assert worst([TAKE, DROP]) == DROP and worst([DROP, CLOSE, TAKE]) == CLOSE
    assert worst([TAKE, TAKE]) == TAKE


@pytest.mark.parametrize("kind", sorted(HUB_RATES))
def test_the_hub_drops_then_closes_a_flood_of_each_kind(kind):
    """Through the hub's protocol: past a kind's rate its frames come out as FrameDropped, and
    a flood of them raises Flooding with close code 4006; other kinds are untouched meanwhile."""
    frames = {"heartbeat": m.Heartbeat(), "lease_request": m.LeaseRequest(1),
              "version_held": m.VersionHeld(0), "relay_report": m.RelayReport(0, "p2", "stall"),
              "transfer_report": m.TransferReport(0, None, 1.0, 0, 0, [])}
    proto = hp.HubProtocol(0.0, 1 << 20, ReadBudget(0.0, rate_bps=1e12, burst_bytes=1 << 40))
    proto.receive_frame(m.encode(m.Hello("a", "transformers", "cpu")), 0.0)
    proto.send(m.Welcome("p1", "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7))
    burst = int(HUB_RATES[kind].burst)
    data = m.encode(frames[kind])
    events = [proto.receive_frame(data, 1.0) for _ in range(burst)]
    assert not any(isinstance(e, hp.FrameDropped) for e in events)
    assert proto.receive_frame(data, 1.0) == hp.FrameDropped(kind)
    other = "heartbeat" if kind != "heartbeat" else "version_held"
    assert not isinstance(proto.receive_frame(m.encode(frames[other]), 1.0), hp.FrameDropped)
    with pytest.raises(Flooding) as err:
        for _ in range(burst + 1):
            proto.receive_frame(data, 1.0)
    assert err.value.code == m.CLOSE_FLOODING == 4006
    assert err.value.reason == f"too many {kind} frames"


def test_a_shared_identity_budget_holds_every_connection_of_it():
    """Two connections of one identity share its budget: together they get its burst."""
    shared = FrameBudget(0.0, RATES)
    protos = []
    for _ in range(2):
        proto = hp.HubProtocol(0.0, 1 << 20, ReadBudget(0.0, rate_bps=1e12, burst_bytes=1 << 40))
        proto.budgets = [FrameBudget(0.0, RATES, scale=100)]  # each connection alone: no limit
        proto.share_budget(shared)
        proto.receive_frame(m.encode(m.Hello("a", "transformers", "cpu")), 0.0)
        proto.send(m.Welcome("p1", "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7))
        protos.append(proto)
    data = m.encode(m.VersionHeld(0))
    events = [protos[i % 2].receive_frame(data, 1.0) for i in range(5)]
    assert [isinstance(e, hp.FrameDropped) for e in events] == [False] * 4 + [True]
