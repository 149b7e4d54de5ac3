"""The learner's batch: when the queued groups make one, and what a hub waiting for one says.

The learner asks (`BatchWanted`); from then on every judged group is a chance to hand it
`prompts_per_step` fresh groups, oldest versions first (`echo2p2p.buffer.RolloutBuffer.take_batch`)
as one `BatchReady`. With dynamic sampling (`grpo.dynamic_sampling`) the buffer never queues a
group whose rewards are all equal, so the batch waits for informative groups; a task the model
always or never solves then gives no batch at all, and the hub says so (a warning at 4, 8, 16 ...
batches' worth of groups filtered since the last batch) rather than wait without a word. Knows
nothing of leases: the core runs a lease pass while a batch is wanted and not ready.
"""

from __future__ import annotations

import logging

from echo2p2p.buffer import RolloutBuffer

from ..config import HubConfig
from .actions import BatchReady, Outbox

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

WARN_BATCHES = 4  # batches' worth of groups filtered in a row before the first warning


class Batching:
    """Whether the learner waits for a batch, and handing it one."""

    def __init__(self, cfg: HubConfig, buffer: RolloutBuffer, outbox: Outbox):
        self.group_size, self.prompts_per_step = cfg.grpo.group_size, cfg.grpo.prompts_per_step
        self.buffer, self.outbox = buffer, outbox
        self.wanted = False  # the learner asked and has not had its batch yet
        self._warned = 0  # groups filtered since the last batch, when last told

    def want(self, step: int) -> None:
        """The learner asks for step `step`'s batch: groups too old for it go first."""
        for group in self.buffer.drop_stale(step):
            log.debug("dropped %s: v%d is too stale for step %d", group.lease_id, group.version,
                      step)
        self.wanted = True

    def offer(self, step: int) -> bool:
        """Emit step `step`'s `BatchReady` if it is wanted and `prompts_per_step` fresh groups
        are queued; whether it was."""
        n = self.prompts_per_step
        if self.wanted and len(self.buffer) >= n and \
                (batch := self.buffer.take_batch(step, n)) is not None:
            self.wanted, self._warned = False, 0
            self.outbox.emit(BatchReady(step, tuple(batch)))
            return True
        self._warn_filtered(step)
        return False

    def _warn_filtered(self, step: int) -> None:
        """Warn when the groups filtered since the last batch reach 4, 8, 16 ... batches' worth."""
        in_a_row = self.buffer.filtered_since_batch
        threshold = WARN_BATCHES * self.prompts_per_step
        while threshold <= self._warned:
            threshold *= 2
        if in_a_row >= threshold:
            self._warned = in_a_row
            log.warning("step %d: %d groups since the last batch had one reward for all %d "
                        "samples and were filtered (grpo.dynamic_sampling); %d of %d informative "
                        "groups queued. The task may be too hard or too easy for the model: "
                        "--no-dynamic-sampling trains on them (they carry no gradient)",
                        step, in_a_row, self.group_size, len(self.buffer), self.prompts_per_step)
