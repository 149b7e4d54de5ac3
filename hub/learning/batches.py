"""A batch as the learner trains it: validated rows with their advantages, micro-batches cut
by a token budget, and the share of each learner rank.

Pure functions over the admitted groups and plain lists, except `padded` (the tensors one
forward takes). Every rank of a sharded learner calls `deal` on the same batch and gets the
same answer, so each knows how many micro-batches the others run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from echo2p2p.buffer import ScoredGroup

from . import grpo


@dataclass(frozen=True)
class Row:
    """One validated sample, ready to pad."""

    ids: list[int]  # prompt + completion
    prompt_len: int
    behaviour: list[float]  # one per completion token (0.0 where not trained)
    advantage: float
    group: int  # its group's place in the batch: ranks are dealt whole groups
    trained: list[bool] | None = None  # per completion token; None: all (an episode's
    # observation tokens are inputs only: no loss, no behaviour logprob)


def batch_rows(groups: Sequence[ScoredGroup], vocab_size: int) -> tuple[list[Row], dict]:
    """Rows to pad, with advantages from each group's rewards; groups built wrong dropped."""
    rows: list[Row] = []
    rewards_all: list[float] = []
    kept = zero_var = dropped_samples = dropped_groups = 0
    for index, g in enumerate(groups):
        prompt = list(g.prompt_ids)
        if (len(g.rewards) != len(g.samples) or not g.samples or not prompt
                or not all(math.isfinite(r) for r in g.rewards)
                or not all(0 <= t < vocab_size for t in prompt)):
            dropped_groups += 1
            dropped_samples += len(g.samples)
            continue
        adv = grpo.group_advantages(torch.tensor(g.rewards, dtype=torch.float32)).tolist()
        kept += 1
        zero_var += all(a == 0.0 for a in adv)
        rewards_all.extend(g.rewards)
        for sample, a in zip(g.samples, adv):
            assert sample.token_ids and max(sample.token_ids) < vocab_size, "unparsed row"
            # <= 0 in exact arithmetic; a float32 hair above (echo2p2p.rows.MAX_LOGPROB) is 0
            rows.append(Row(prompt + list(sample.token_ids), len(prompt),
                            [min(x, 0.0) for x in sample.behaviour()], float(a), index,
                            sample.trained() if sample.packed_turns else None))
    r = torch.tensor(rewards_all, dtype=torch.float64)
    info = {
        "reward_mean": float(r.mean()) if len(rewards_all) else 0.0,
        "reward_std": float(r.std(unbiased=False)) if len(rewards_all) else 0.0,
        "groups": kept, "zero_variance_groups": zero_var,
        "dropped_samples": dropped_samples, "dropped_groups": dropped_groups,
    }
    return rows, info


def padded(rows: Sequence[Row], pad_id: int) -> tuple[Tensor, ...]:
    """Right-padded (input ids, attention mask, completion mask, behaviour logprobs), all
    (B, T), and advantages (B,), on the CPU. The completion mask holds the tokens trained on:
    an episode's observation tokens are not."""
    width = max(len(r.ids) for r in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((b, width), dtype=torch.long)  # (B, T)
    completion = torch.zeros((b, width), dtype=torch.bool)  # (B, T)
    behaviour = torch.zeros((b, width), dtype=torch.float32)  # (B, T)
    for i, r in enumerate(rows):
        n = len(r.ids)
        input_ids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
        attention[i, :n] = 1
        completion[i, r.prompt_len:n] = True if r.trained is None else torch.tensor(r.trained)
        behaviour[i, r.prompt_len:n] = torch.tensor(r.behaviour, dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)  # (B,)
    return input_ids, attention, completion, behaviour, advantages


def left_padded(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(input ids, attention mask), both (B, T), left-padded: generation appends on the right."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        attention[i, width - len(s):] = 1
    return ids, attention


def micro_batches(rows: Sequence[Row], budget_tokens: int) -> list[list[Row]]:
    """`rows` cut into micro-batches of at most `budget_tokens` padded tokens (rows x the
    longest), longest first so that lengths pack together; a row longer than the budget goes
    alone. The batch's memory then follows the budget, not its longest completion."""
    out: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: -len(r.ids)):  # stable: ties keep batch order
        if out and (len(out[-1]) + 1) * len(out[-1][0].ids) <= budget_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def deal(rows: Sequence[Row], world: int) -> list[list[Row]]:
    """`rows` dealt to `world` ranks by whole groups: the groups with the most tokens first,
    each to the rank with the fewest tokens so far among those below their fair number of
    groups (ceil(groups / world)). Deterministic: every rank computes every rank's share."""
    by_group: dict[int, list[Row]] = {}
    for r in rows:
        by_group.setdefault(r.group, []).append(r)
    size = {g: sum(len(r.ids) for r in group) for g, group in by_group.items()}
    fair = math.ceil(len(by_group) / world)
    shares: list[list[Row]] = [[] for _ in range(world)]
    tokens, counts = [0] * world, [0] * world
    for g in sorted(by_group, key=lambda g: -size[g]):
        rank = min((r for r in range(world) if counts[r] < fair), key=lambda r: tokens[r])
        shares[rank].extend(by_group[g])
        tokens[rank] += size[g]
        counts[rank] += 1
    return shares
