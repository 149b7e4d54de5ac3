"""The step record (`hub.run.step_record`) is laid out from plain values: the learner's metrics, the
batch, the caller's measured rates and one `Hub.statistics()`."""

from collections import Counter

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.hub.run.step_record import step_record
from echo2p2p.tasks import AdditionTask
from echo2p2p.hub.core.events import StepFinished


async def test_a_step_record_reads_the_hubs_statistics_and_the_callers_values():
    """Totals come from the hub's statistics, rates and times as the caller measured them, the
    staleness from the batch's lags; a hub without a scorer counts no score timeouts."""
    task = AdditionTask()
    hub = Hub(HubConfig.from_flat(prompts_per_step=2), "run", task,
              [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
    hub.feed(StepFinished())
    stats = hub.statistics()
    record = step_record(0, stats, {"train/loss": 0.5}, ["a", "b", "c"], Counter({0: 1, 2: 2}),
                         time_s=2.0004, rollouts_per_s=4.0, busy_frac=0.25, tokens_per_s=100.0,
                         capacity={"capacity/train_step_s": 1.5})
    assert (record["step"], record["version"], record["time_s"]) == (0, 1, 2.0)
    assert record["train/loss"] == 0.5 and record["capacity/train_step_s"] == 1.5
    assert record["rollout/staleness_hist"] == {"0": 1, "2": 2}
    assert record["rollout/staleness_mean"] == 4 / 3 and record["rollout/leases"] == ["a", "b", "c"]
    assert (record["rollout/per_s"], record["hub/learner_busy_frac"],
            record["train/tokens_per_s"]) == (4.0, 0.25, 100.0)
    assert record["rollout/admitted_groups_total"] == stats.admitted_groups == 0
    assert record["hub/peers"] == 0 and record["hub/score_timeouts_total"] == 0
    assert record["cost/usd_total"] == stats.cost["cost/usd_total"] == 0.0
