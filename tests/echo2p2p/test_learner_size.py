"""The hub's footprint rules (echo2p2p.learner_size): micro-batches within a memory budget that
counts the vocabulary, checkpoint cadence and catch-up depth within disk budgets, the prediction."""

from __future__ import annotations

from echo2p2p.learner_size import (
    ModelShape, catch_up_versions_within, checkpoint_every_within, hub_footprint,
    micro_batch_bytes_per_token, micro_tokens_within)

GIB = 2 ** 30
SMOL = ModelShape(134_515_008, 28_311_552, 576, 30, 49152)  # SmolLM2-135M, tied embeddings
TINY = ModelShape(751_296, 64_000, 64, 2, 101)


def test_micro_batch_counts_the_vocabulary():
    """A token of SmolLM2 costs its activations and 12 bytes per vocabulary entry; 2 GiB hold
    about 800 of them, not the tiny model's 16384."""
    per_token = micro_batch_bytes_per_token(SMOL)
    assert per_token == 576 * 121.0 * 30 + 49152 * 12.0
    tokens = micro_tokens_within(SMOL, 2 * GIB, 16384)
    assert 700 < tokens < 900
    assert tokens * per_token <= 2 * GIB < (tokens + 1) * per_token
    assert micro_tokens_within(TINY, 2 * GIB, 16384) == 16384
    assert micro_tokens_within(SMOL, 1, 16384) == 1  # a longer sample still goes alone
    assert micro_tokens_within(SMOL, 2 * GIB, 16384, checkpointing=True) > tokens


def test_checkpoint_cadence_within_its_disk_budget():
    """12 P bytes a checkpoint: every version for tiny, every 7th for SmolLM2 at 256 MiB a
    version; never fewer versions apart than asked, and 0 (never) stays 0."""
    assert checkpoint_every_within(TINY.params, 1, 256 * 2 ** 20) == 1
    assert checkpoint_every_within(SMOL.params, 1, 256 * 2 ** 20) == 7
    assert checkpoint_every_within(SMOL.params, 10, 256 * 2 ** 20) == 10
    assert checkpoint_every_within(SMOL.params, 1, 0) == 1
    assert checkpoint_every_within(SMOL.params, 0, 256 * 2 ** 20) == 0


def test_catch_up_depth_within_its_disk_budget():
    """2 P bytes a stream: 16 for tiny, 4 (S + 2) for SmolLM2 in 1 GiB, 16 without a budget."""
    assert catch_up_versions_within(TINY.params, 16, 2, GIB) == 16
    assert catch_up_versions_within(SMOL.params, 16, 2, GIB) == 4
    assert catch_up_versions_within(SMOL.params, 16, 2, 0) == 16
    assert catch_up_versions_within(SMOL.params, 1, 2, GIB) == 1  # never more than asked
    assert catch_up_versions_within(50_000_000, 16, 2, GIB) == 9  # 10 streams of 100 MB fit


def test_footprint_is_the_sum_of_its_parts():
    micro = micro_tokens_within(SMOL, 2 * GIB, 16384)
    f = hub_footprint(SMOL, micro, kept_streams=5, kept_versions=3, checkpoint_every=7)
    assert f.ram_bytes == sum(f.ram_parts.values())
    assert f.ram_parts["learner state"] == 16 * SMOL.params
    assert f.ram_parts["micro-batch"] <= 2 * GIB
    assert f.ram_bytes < 9e9  # was 15.5 GB measured with 16384-token micro-batches
    assert f.disk_parts["checkpoints"] == 2 * 12 * SMOL.params
    assert f.disk_parts["streams"] == 5 * 2 * SMOL.params
    assert f.disk_per_version_bytes == 4 * SMOL.params + 12 * SMOL.params / 7
    assert "predicted hub footprint: RAM" in f.line()
    never = hub_footprint(SMOL, micro, checkpoint_every=0)
    assert never.disk_parts["checkpoints"] == 0 and never.disk_per_version_bytes == 4 * SMOL.params
