"""The hub's memory, predicted and fitted: every part of the predicted footprint, the demo's
local peers by engine, the fitting to a --max-memory budget (micro-batches lowered, or a refusal
naming what to change), `--print-config` showing the fitted values, and the time-based
checkpoint cadence."""

from __future__ import annotations

import json

import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.hub.cli import main
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.checkpoint import checkpoint_due
from echo2p2p.hub.learning.fitting import LocalPeers, fit, predicted_footprint
from echo2p2p.learner_size import (ALLOCATOR_SLACK, PEER_BYTES_PER_PARAM, PEER_RUNTIME_BYTES,
                                   RUNTIME_BYTES, WORKER_BYTES, ModelShape, hub_footprint,
                                   micro_batch_bytes_per_token, peer_bytes)

P = 134_515_008
SMOL = ModelShape(P, 28_311_552, 576, 30, 49152)  # SmolLM2-135M, tied embeddings
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


def test_every_part_of_the_hub_footprint_is_counted():
    """Each part has its own figure, and the whole is their sum: dropping one (the allocator's
    slack, the scoring workers, the streams read back, the resume's load) changes the total."""
    f = hub_footprint(SMOL, 800, score_workers=1, spot_tokens=768, read_streams=3)
    micro = 800 * micro_batch_bytes_per_token(SMOL)
    assert f.ram_parts == pytest.approx({
        "learner state": 16 * P, "micro-batch": micro, "allocator slack": ALLOCATOR_SLACK * micro,
        "spot-checker": 4 * P + 768 * 49152 * 8.0, "publication": 4 * P,
        "read streams": 3 * 2 * P, "resume load": 0.0, "runtime": RUNTIME_BYTES,
        "scoring workers": 2 * WORKER_BYTES})
    assert f.ram_bytes == pytest.approx(sum(f.ram_parts.values()))
    assert 8.0e9 < f.ram_bytes < 9.0e9  # SmolLM2-135M: issue 45 measured 8.2-9.4 GB
    resumed = hub_footprint(SMOL, 800, score_workers=1, spot_tokens=768, read_streams=3,
                            resumed=True)
    assert resumed.ram_bytes - f.ram_bytes == pytest.approx(12 * P)
    more = hub_footprint(SMOL, 800, score_workers=3, spot_tokens=768, read_streams=3)
    assert more.ram_bytes - f.ram_bytes == pytest.approx(2 * WORKER_BYTES)
    off = hub_footprint(SMOL, 800, spot_check=False, score_workers=1, read_streams=1)
    assert f.ram_bytes - off.ram_bytes == pytest.approx(4 * P + 768 * 49152 * 8.0 + 2 * 2 * P)


def test_the_config_names_what_the_footprint_counts():
    """S + 1 streams read back with spot-checks (1 without), group x (prompt + completion)
    tokens in a check's forward, score_workers + the evaluation's worker."""
    cfg = HubConfig.from_flat(max_lag=2, group_size=8, max_new_tokens=32, score_workers=2,
                              learner_micro_bytes=0, learner_micro_tokens=800)
    parts = predicted_footprint(cfg, SMOL).ram_parts
    assert parts["read streams"] == 3 * 2 * P
    assert parts["spot-checker"] == 4 * P + 8 * (64 + 32) * 49152 * 8.0
    assert parts["scoring workers"] == 3 * WORKER_BYTES
    off = predicted_footprint(cfg.replace(spot_check_fraction=0.0), SMOL).ram_parts
    assert off["read streams"] == 2 * P and off["spot-checker"] == 0


def test_local_peers_are_counted_by_engine():
    """A transformers peer: runtime + 16 P (SmolLM2: ~2.75 GB, measured 1.95-3.1); vLLM: its
    engine and 1 GiB of KV cache besides (~5.4 GB, measured 5.5)."""
    assert peer_bytes(SMOL, "transformers") == PEER_RUNTIME_BYTES + PEER_BYTES_PER_PARAM * P
    assert 2.5e9 < peer_bytes(SMOL, "transformers") < 3.1e9
    assert 5.0e9 < peer_bytes(SMOL, "vllm") < 6.0e9
    cfg = HubConfig.from_flat(model="smollm2-135m")
    two = fit(cfg, SMOL, 100e9, LocalPeers(2, "vllm"))
    assert two.total_bytes == pytest.approx(two.footprint.ram_bytes + 2 * peer_bytes(SMOL, "vllm"))
    assert fit(cfg, SMOL, 100e9).peers_bytes == 0


def test_a_budget_that_fits_lowers_the_micro_batch_and_says_why():
    """The real-model demo with 2 transformers peers in 13 GB: micro-batches lowered below the
    801 that learner_micro_bytes allows, the total within the budget, the reason given."""
    cfg = HubConfig.from_flat(max_memory="13GB")
    roomy = fit(cfg, SMOL, 100e9, LocalPeers(2))
    fitted = fit(cfg, SMOL, 13e9, LocalPeers(2), budget_given=True)
    assert roomy.cfg.learner.learner_micro_tokens == 801
    assert 256 <= fitted.cfg.learner.learner_micro_tokens < 801
    assert roomy.total_bytes > 13e9 >= fitted.total_bytes
    assert "801 -> " in fitted.why["learner_micro_tokens"] and "13.0 GB" in fitted.why["learner_micro_tokens"]
    assert fitted.why["checkpoint_every"].startswith("fitted: 1 -> 7")
    assert not fitted.warning


def test_a_budget_too_small_is_refused_naming_what_to_change():
    """Set by the user: a ConfigError on max_memory naming the budget and the changes; the
    machine's available memory (not set): the same sentence as a warning, the hub starts."""
    cfg = HubConfig.from_flat(max_memory="6GB")
    with pytest.raises(ConfigError) as refused:
        fit(cfg, SMOL, 6e9, LocalPeers(2), budget_given=True)
    said = str(refused.value)
    assert refused.value.field == "max_memory" and "6.0 GB is all it may use" in said
    for change in ("--max-memory", "--peers", "--spot-check-fraction 0", "--learner-checkpointing"):
        assert change in said, change
    warned = fit(HubConfig(), SMOL, 6e9, LocalPeers(2))
    assert "6.0 GB is all it may use" in warned.warning
    assert warned.cfg.learner.learner_micro_tokens == 256  # as far down as it goes


def test_max_memory_is_a_size_with_a_unit():
    assert HubConfig.from_flat(max_memory="12.5GiB").memory.max_memory_bytes == int(12.5 * 2 ** 30)
    assert HubConfig.from_flat(max_memory="800MB").memory.max_memory_bytes == 800_000_000
    assert HubConfig().memory.max_memory_bytes is None
    for bad in ("lots", "16 parsecs", "0GB"):
        with pytest.raises(ConfigError, match="max_memory"):
            HubConfig.from_flat(max_memory=bad)
    with pytest.raises(ConfigError, match="checkpoint_every_s"):
        HubConfig.from_flat(checkpoint_every_s=-1.0)


@pytest.fixture
def smol_dir(tmp_path):
    """SmolLM2-135M's config.json alone: its shape, no weights."""
    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "config.json").write_text(json.dumps(SMOLLM2))
    return tmp_path / "smol"


def test_print_config_shows_the_values_after_fitting(smol_dir, capsys):
    """What the hub will use: the fitted micro-batch and checkpoint cadence with why, and the
    predicted hub and demo footprints; a budget too small fails the same way a start would."""
    assert main(["demo", "--model", str(smol_dir), "--max-memory", "13GB", "--print-config"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    tokens = int(rows["learner_micro_tokens"].split()[1])
    assert 256 <= tokens < 801 and "fitted: 801 -> " in rows["learner_micro_tokens"]
    assert rows["checkpoint_every"].split()[1] == "7" and "fitted: 1 -> 7" in rows["checkpoint_every"]
    assert "predicted hub footprint: RAM" in out and "2 local transformers peer(s)" in out
    assert main(["demo", "--model", str(smol_dir), "--max-memory", "4GB", "--print-config"]) == 1
    assert "max_memory" in capsys.readouterr().err


def test_checkpoints_come_by_version_count_or_by_the_clock():
    """Every 7th publication, or the first one 180 s of training after the last checkpoint;
    the first publication always; never with checkpoints off."""
    due = lambda published, now, last: checkpoint_due(published, now, last, every=7, every_s=180.0)  # noqa: E731
    assert due(0, 0.0, None)
    assert not due(1, 40.0, 0.0) and not due(3, 179.9, 0.0)
    assert due(4, 180.0, 0.0)  # by the clock, three versions early
    assert due(7, 10.0, 5.0)  # by the count, however soon
    assert not checkpoint_due(4, 1e6, 0.0, every=7, every_s=0.0)  # by count only
    assert not checkpoint_due(0, 1e6, None, every=0, every_s=180.0)  # checkpoints off
