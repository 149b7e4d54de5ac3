"""While its engine starts (a vLLM engine's first start compiles the model: minutes on a CPU),
a peer says so at intervals, how long so far and why; a lost connection does not cancel the
build; the vLLM engine keeps its compile cache beside the peer's model files."""

from __future__ import annotations

import asyncio
import logging

from echo2p2p.peer import swapper
from echo2p2p.peer.config import PeerConfig
from tests.conftest import until_logged


async def test_a_slow_engine_start_is_said_at_intervals(caplog, monkeypatch):
    monkeypatch.setattr(swapper, "BUILD_NOTICE_S", 0.01)
    caplog.set_level(logging.INFO, logger="echo2p2p.peer")
    building = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(swapper.wait_built(building, "vllm"))

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]

    await until_logged(lambda: len(said()) >= 2, 30)
    assert said()[0].startswith("still starting the vllm engine: 0 s so far (a first start "
                                "compiles the model; a restart loads it from the cache)")
    engine = object()
    building.set_result(engine)
    assert await waiting is engine


async def test_a_wait_cancelled_leaves_the_build_running():
    building = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(swapper.wait_built(building, "transformers"))
    await asyncio.sleep(0)  # let it start waiting
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert not building.cancelled()  # the next connection waits on the same build
    building.cancel()


def test_the_vllm_compile_cache_lives_in_the_model_cache(tmp_path):
    cfg = PeerConfig(model_cache=str(tmp_path / "models"))
    assert swapper.vllm_cache_dir(cfg) == tmp_path / "models" / "vllm"
