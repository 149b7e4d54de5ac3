"""--report-to: a real run's records reach TensorBoard's event files and an offline wandb run
under the run log's names, read back with each tool's own reader; a missing package, or wandb
online without a login, fails the start with a ConfigError before the policy loads."""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from pathlib import Path

import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.view.experiment_trackers import open_trackers
from echo2p2p.hub.run.start import start_hub

from tests.conftest import running_peers

WANDB_BLOCK = 32 << 10  # the .wandb file is a LevelDB-style log of 32 KiB blocks


async def run_briefly(cfg) -> list[dict]:
    """Train `cfg` with 2 real peers to its max_steps; the run log's records, read back."""
    async with start_hub(cfg) as run, running_peers(run.url, 2):
        await asyncio.wait_for(run.finished.wait(), 60)
    lines = (Path(cfg.run.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def charted(records: list[dict]) -> dict[str, dict[int, float]]:
    """What a tracker should chart, by name and x, spelled out from the records: a step's
    numbers at its step (its staleness counts by lag), the base evaluation at version 0, a
    propagation's numbers (and its serving times) at its version."""
    want: dict[str, dict[int, float]] = {}

    def put(name, x, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            want.setdefault(name, {})[x] = value

    for r in records:
        if "event" not in r:
            for key, value in r.items():
                if isinstance(value, dict):  # rollout/staleness_hist: groups by lag
                    for sub, number in value.items():
                        for inner, n in (number.items() if isinstance(number, dict) else
                                         [(None, number)]):  # by_lag: ratios by lag
                            put(f"{key}/{sub}" + (f"/{inner}" if inner else ""), r["step"], n)
                elif key != "step":
                    put(key, r["step"], value)
        elif r["event"] == "eval":
            put("eval/accuracy", r["version"], r["eval/accuracy"])
        elif r["event"] == "propagation":
            for key, value in r.items():
                if key not in ("version", "serving"):
                    put(f"propagation/{key}", r["version"], value)
            for key, value in r["serving"].items():
                put(f"propagation/serving/{key}", r["version"], value)
    return want


async def test_tensorboard_charts_every_number_of_the_run_log(hub_cfg):
    """TensorBoard's scalars are the run log's numbers, same names, same values at each step
    (versions for propagation), as TensorBoard's own reader reads the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = hub_cfg.replace(max_steps=6, eval_every=3, report_to="tensorboard")
    want = charted(await run_briefly(cfg))
    assert {"train/reward_mean", "eval/accuracy", "hub/learner_busy_frac",
            "rollout/staleness_hist/0", "propagation/t90_s", "by_lag/0/ratio_mean"} <= set(want)
    events = EventAccumulator(str(Path(cfg.run.run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(want)
    for name, points in want.items():
        got = {e.step: e.value for e in events.Scalars(name)}
        assert got == pytest.approx(points, rel=1e-6, abs=1e-9), name  # stored as float32
    assert 0 in want["eval/accuracy"] and 5 in want["eval/accuracy"]  # base, then after step 6


def wandb_records(path: Path):
    """The records of a .wandb file, by wandb's own protobuf schema: a 7-byte header, then
    records split over 32 KiB blocks, each piece behind a 7-byte header (crc, length, type:
    1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, piece = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the block's zero padding
            pos += left
            continue
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(piece)
            piece = b""
            yield record


def items(entries) -> dict:
    """A history row's, summary's or config's items by name (wandb keeps a name with a "/" as
    a one-element nested key)."""
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}


async def test_wandb_offline_run_holds_the_run_log(hub_cfg, monkeypatch, tmp_path):
    """With WANDB_MODE=offline the run is on disk, named by the run id, in the run dir; its
    history has every step's reward at its step and its summary the last one's."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "WANDB_DIR": str(tmp_path / "elsewhere")}.items():
        monkeypatch.setenv(name, value)
    cfg = hub_cfg.replace(max_steps=3, report_to="wandb", dashboard_token="s3cret")
    records = await run_briefly(cfg)
    run_id = json.loads((Path(cfg.run.run_dir) / "config.json").read_text())["run_id"]
    (offline,) = (Path(cfg.run.run_dir) / "wandb").glob(f"offline-run-*-{run_id}")
    history, summary, config = {}, {}, {}
    for record in wandb_records(offline / f"run-{run_id}.wandb"):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = items(record.history.item)
            if "train/reward_mean" in row:
                history[row["step"]] = row["train/reward_mean"]
        elif kind == "summary":
            summary.update(items(record.summary.update))
        elif kind == "run":
            config = items(record.run.config.update)
    steps = [r for r in records if "event" not in r]
    assert history == {r["step"]: r["train/reward_mean"] for r in steps}
    assert summary["train/reward_mean"] == steps[-1]["train/reward_mean"]
    assert config["run_id"] == run_id and config["max_steps"] == 3
    assert "dashboard_token" not in config  # a secret: wandb uploads its config
    assert "s3cret" not in (Path(cfg.run.run_dir) / "config.json").read_text()  # nor in the run dir


async def test_a_tracker_without_its_package_stops_the_start(hub_cfg, monkeypatch):
    """A missing tracker package is a ConfigError on report_to naming the extra to install,
    raised at start-up: no step is trained, and the new run's directory is removed again."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as raised:
        async with start_hub(hub_cfg.replace(max_steps=1, report_to="wandb")):
            pass
    assert raised.value.field == "report_to" and "echo2p2p[wandb]" in str(raised.value)
    assert not Path(hub_cfg.run.run_dir).exists()


def test_wandb_without_a_login_is_a_config_error(tmp_path, monkeypatch):
    """Online wandb with no API key is a ConfigError on report_to saying how to log in or
    stay offline, not wandb's own exception."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in {"WANDB_MODE": "online", "WANDB_SILENT": "true", "HOME": str(tmp_path),
                        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        open_trackers(HubConfig.from_flat(report_to="wandb").view, tmp_path / "run", "r1", {})
    assert raised.value.field == "report_to"
    assert "wandb login" in str(raised.value) and "WANDB_MODE=offline" in str(raised.value)
