"""Configs and CLIs: defaults, TOML and flags layered; bad values name their field."""

import dataclasses
import inspect
import subprocess
import sys

import pytest

from echo2p2p.config import as_dict, field_docs, owners, resolve, sections
from echo2p2p.errors import ConfigError
from echo2p2p.hub import cli as hub_cli
from echo2p2p.hub.config import HubConfig, help_texts as hub_help
from echo2p2p.hub.config_sections import StalenessConfig
from echo2p2p.peer import cli as peer_cli
from echo2p2p.peer.config import PeerConfig, help_texts as peer_help, normalize_url


def test_every_config_field_has_help():
    """Each field's docstring is its --help text (the hub's: every field of every section)."""
    for cls, help_texts in ((HubConfig, hub_help), (PeerConfig, peer_help)):
        docs = help_texts(cls)
        missing = [f for f in as_dict(cls()) if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    assert len(as_dict(HubConfig())) == len(hub_help(HubConfig)) == 92


def test_hub_config_sections_share_no_field_name():
    """Flags and TOML keys are flat, so a field name belongs to one section only; each
    section and HubConfig's own fields (the sections) are documented."""
    owner = owners(HubConfig)
    assert set(owner) == set(as_dict(HubConfig())) and len(set(owner.values())) == 12
    assert owner["lr"] == "grpo" and owner["max_lag"] == "staleness"
    assert set(field_docs(inspect.getsource(HubConfig))) == set(sections(HubConfig))
    assert all(kind.__doc__ and not kind.__doc__.startswith(kind.__name__ + "(")
               for kind in sections(HubConfig).values())


def test_toml_takes_flat_keys_and_section_tables():
    """A TOML table sets fields by their flat names or in section tables, the same config
    either way; a key in the wrong section names it."""
    flat = resolve(HubConfig, {"lr": 0.01, "max_lag": 3, "dashboard_port": -1})
    tables = resolve(HubConfig, {"grpo": {"lr": 0.01}, "staleness": {"max-lag": 3},
                                 "dashboard_port": -1})
    assert flat == tables and flat.grpo.lr == 0.01 and flat.view.dashboard_port == -1
    with pytest.raises(ConfigError) as info:
        resolve(HubConfig, {"grpo": {"max_lag": 3}})
    assert info.value.field == "grpo.max_lag" and "lr" in str(info.value)


def test_saved_config_reads_back():
    """The flat dict saved with a run (config.json) resolves to the same config, and so does
    the nested one of `dataclasses.asdict` (section tables)."""
    cfg = HubConfig.from_flat(lr=0.01, max_lag=4, relay="gossip", learner_checkpointing=True)
    assert resolve(HubConfig, as_dict(cfg)) == cfg
    assert resolve(HubConfig, dataclasses.asdict(cfg)) == cfg
    assert as_dict(cfg)["lr"] == 0.01 and "grpo" not in as_dict(cfg)


def test_from_flat_and_replace_check_the_sections():
    """`from_flat` and `replace` take flat names, check the section again, and name an
    unknown field."""
    cfg = HubConfig.from_flat(max_lag=3, lr=1e-4)
    assert cfg.replace(max_lag=1).staleness == StalenessConfig(max_lag=1)
    assert cfg.replace(max_lag=1).grpo is cfg.grpo  # untouched sections are shared
    with pytest.raises(ConfigError) as info:
        cfg.replace(max_lag=0, publish_every=3)
    assert info.value.field == "publish_every"
    with pytest.raises(ConfigError) as info:
        HubConfig.from_flat(max_lagg=1)
    assert info.value.field == "max_lagg"


def test_field_docs_reads_the_docstring_under_each_field_of_a_source_text():
    """field_docs parses source text (no file read): a field without a docstring has none, and
    a docstring's whitespace is folded to single spaces."""
    source = (
        "    @dataclass(frozen=True)\n"
        "    class Knobs:\n"
        "        lag: int = 2\n"
        '        """How far\n           behind."""\n'
        "        bare: int = 0\n"
        "        rate: float = 1.0\n"
        '        """Per second."""\n')
    assert field_docs(source) == {"lag": "How far behind.", "rate": "Per second."}


def test_flags_override_toml_override_defaults():
    """defaults < TOML < flags, with types converted."""
    cfg = resolve(HubConfig, {"max_lag": 4, "lr": 0.01}, {"max_lag": "3", "port": None})
    assert (cfg.staleness.max_lag, cfg.grpo.lr, cfg.network.port) == (3, 0.01, 8765)
    assert cfg.staleness.kappa == 2


@pytest.mark.parametrize("toml, flags, field", [
    ({"max_lagg": 1}, {}, "max_lagg"),
    ({}, {"max_lag": "-1"}, "max_lag"),
    ({}, {"lr": "fast"}, "lr"),
    ({"max_lag": 1, "publish_every": 3}, {}, "publish_every"),
    ({}, {"group_size": "1"}, "group_size"),
    ({}, {"weights_dtype": "int8"}, "weights_dtype"),
    ({"relay": "mesh"}, {}, "relay"),
    ({}, {"chunk_bytes": "-1"}, "chunk_bytes"),
    ({}, {"anchor_every": "0"}, "anchor_every"),
    ({"keep_versions": 1}, {}, "keep_versions"),
    ({}, {"spot_check_fraction": "1.5"}, "spot_check_fraction"),
    ({"spot_check_tokens": -1}, {}, "spot_check_tokens"),
    ({}, {"spot_check_tolerance": "0"}, "spot_check_tolerance"),
])
def test_bad_config_names_the_field(toml, flags, field):
    """A bad value raises ConfigError that names the offending field."""
    with pytest.raises(ConfigError) as info:
        resolve(HubConfig, toml, flags)
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize("table", ["[hub]", "[hub.staleness]"])
def test_hub_cli_reports_bad_toml_field(tmp_path, capsys, table):
    """`echo2-hub serve --config bad.toml` exits 1 naming the field, before loading anything,
    whether the file sets it in the [hub] table or in its section's."""
    bad = tmp_path / "bad.toml"
    bad.write_text(f"{table}\nmax_lag = 1\npublish_every = 5\n")
    assert hub_cli.main(["serve", "--config", str(bad)]) == 1
    assert "publish_every" in capsys.readouterr().err


def test_peer_cli_rejects_unknown_engine(capsys):
    """`echo2-peer join --engine nope` exits 1 naming the field."""
    assert peer_cli.main(["join", "127.0.0.1:1", "--engine", "nope"]) == 1
    assert "engine" in capsys.readouterr().err


def test_hub_url_spellings():
    """host:port, http:// and ws:// all become ws://host:port/ws."""
    assert normalize_url("10.0.0.5:8765") == "ws://10.0.0.5:8765/ws"
    assert normalize_url("http://h:1") == "ws://h:1/ws"
    assert normalize_url("wss://h:1/ws") == "wss://h:1/ws"
    with pytest.raises(ConfigError):
        normalize_url("ftp://h:1")


def test_help_does_not_import_torch():
    """--help answers without importing torch, transformers, vllm, math-verify (sympy),
    aiohttp or numpy."""
    code = ("import sys; from hub import cli; "
            "sys.argv=['echo2-hub','serve','--help']\n"
            "try: cli.main()\nexcept SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'sympy', 'math_verify',"
            " 'aiohttp', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--max-lag" in done.stdout and "staleness bound" in done.stdout


@pytest.mark.parametrize("name", ["demo.toml", "math.toml", "gsm8k.toml"])
def test_example_configs_are_valid(name):
    """The shipped example configs resolve to valid hub configs; the GPU ones (device = "cuda"),
    on a machine without CUDA, are refused naming the device and the fix, and resolve with
    --device cpu."""
    import pathlib
    import tomllib

    import torch

    path = pathlib.Path(__file__).parents[2] / "examples" / name
    table = tomllib.loads(path.read_text())["hub"]
    if table.get("device", "cpu").startswith("cuda") and torch.cuda.device_count() == 0:
        with pytest.raises(ConfigError) as info:
            resolve(HubConfig, table)
        assert info.value.field == "device" and "--device cpu" in str(info.value)
        table = {**table, "device": "cpu"}
    cfg = resolve(HubConfig, table)
    assert cfg.staleness.kappa <= cfg.staleness.max_lag + 1


@pytest.mark.parametrize("pin", ["zz" * 32, "ab" * 31])
def test_bad_hub_key_pin_names_the_field(pin):
    """--hub-key must be 64 hex digits; anything else is refused naming hub_key."""
    with pytest.raises(ConfigError) as info:
        PeerConfig(hub_key=pin)
    assert info.value.field == "hub_key"
    assert PeerConfig(hub_key="ab" * 32).pinned_hub_key == bytes.fromhex("ab" * 32)


@pytest.mark.parametrize("fields, field", [
    ({"listen": "nope"}, "listen"),
    ({"listen": "host:99999"}, "listen"),
    ({"advertise": "203.0.113.7:7000"}, "advertise"),
    ({"keep_versions": 1}, "keep_versions"),
    ({"upload_limit_mbps": -1.0}, "upload_limit_mbps"),
    ({"relay_stall_s": 0.0}, "relay_stall_s"),
])
def test_bad_relay_settings_name_the_field(fields, field):
    """The peer's chunk-server and download settings are checked at start, naming the field."""
    with pytest.raises(ConfigError) as info:
        PeerConfig(**fields)
    assert info.value.field == field
    assert PeerConfig(listen="").listen_host_port == ("", 0)
    assert PeerConfig(listen="[::1]:7000").listen_host_port == ("::1", 7000)
