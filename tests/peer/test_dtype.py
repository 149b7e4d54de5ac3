"""`echo2-peer join --dtype` (issue 45, item 2): what the engine computes in, said in the hello."""

from __future__ import annotations

import pytest
import torch

from echo2p2p.errors import ConfigError
from echo2p2p.peer import cli
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.swapper import build_engine


def test_dtype_is_checked_and_resolved_per_engine():
    """'' is the engine's default (transformers float32; vLLM float32 on a CPU, bf16 on a GPU,
    read from the config alone); a dtype no engine runs is refused naming the flag."""
    assert PeerConfig().engine_dtype == "float32"
    assert PeerConfig(dtype="bfloat16").engine_dtype == "bfloat16"
    assert PeerConfig(engine="relay").engine_dtype == ""
    with pytest.raises(ConfigError) as exc:
        PeerConfig(dtype="float16")
    assert exc.value.field == "dtype" and "bfloat16" in exc.value.problem


def test_join_takes_the_flag(capsys):
    """`echo2-peer join --help` lists --dtype in the worker group; a bad value exits 1 naming it."""
    with pytest.raises(SystemExit):
        cli.main(["join", "--help"])
    assert "--dtype" in capsys.readouterr().out
    assert cli.main(["join", "127.0.0.1:1", "--dtype", "fp8"]) == 1
    assert "dtype" in capsys.readouterr().err


def test_bf16_transformers_engine_is_built_in_bf16():
    """The peer's engine holds its model in the dtype asked for."""
    engine = build_engine(PeerConfig(dtype="bfloat16"), "tiny")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in build_engine(PeerConfig(), "tiny").model.parameters()} == {torch.float32}
