"""What a vLLM engine sets before vLLM starts (no vLLM needed to check it): AOT compile off,
both compile caches under the peer's cache, the user's own settings left alone; and the one
vLLM warning a volunteer cannot act on is dropped, and no other."""

from __future__ import annotations

import logging

import pytest

from echo2p2p.policy import vllm_setup

VARS = ("VLLM_USE_AOT_COMPILE", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "OMP_NUM_THREADS")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_caches_go_under_the_peers_cache(clean_env, tmp_path):
    import os

    vllm_setup.prepare(cache_dir=tmp_path / "vllm", threads=0, on_cpu=True)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "vllm" / "inductor")
    assert "OMP_NUM_THREADS" not in os.environ  # 0: vLLM's default


def test_what_the_user_set_is_kept(clean_env, tmp_path):
    import os

    clean_env.setenv("VLLM_CACHE_ROOT", "/somewhere")
    clean_env.setenv("VLLM_USE_AOT_COMPILE", "1")
    clean_env.setenv("OMP_NUM_THREADS", "3")
    vllm_setup.prepare(cache_dir=tmp_path, threads=1, on_cpu=True)
    assert os.environ["VLLM_CACHE_ROOT"] == "/somewhere"
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1" and os.environ["OMP_NUM_THREADS"] == "3"


def test_threads_on_a_cpu(clean_env, tmp_path):
    import os

    import torch

    before = torch.get_num_threads()
    try:
        vllm_setup.prepare(cache_dir=None, threads=1, on_cpu=True)
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tied", [True, False])
def test_the_harmless_warnings_alone_are_dropped(caplog, tied):
    """The tied head's reload warning goes only for a tied head; another layer's stays, and
    everything is said again once the filter is removed."""
    reload_log = logging.getLogger(vllm_setup.NOISY_LOGGERS[0])
    worker_log = logging.getLogger(vllm_setup.NOISY_LOGGERS[1])

    def say() -> None:
        for layer in ("ParallelLMHead", "RotaryEmbedding", "QKVParallelLinear"):
            reload_log.warning("%s: Failed to load weights", layer)
        worker_log.warning(vllm_setup.SET_THREADS)
        logging.getLogger(vllm_setup.NOISY_LOGGERS[2]).warning(vllm_setup.GLOBAL_SEED, 7)

    with caplog.at_level(logging.WARNING):
        notices = vllm_setup.HarmlessNotices(tied=tied).install()
        say()
        notices.remove()
        kept = [r.getMessage() for r in caplog.records]
        caplog.clear()
        say()
    assert kept == ["QKVParallelLinear: Failed to load weights"] if tied else \
        ["ParallelLMHead: Failed to load weights", "QKVParallelLinear: Failed to load weights"]
    assert len(caplog.records) == 5


def test_torchs_own_default_is_replaced(clean_env, tmp_path):
    """Torch writes its default inductor directory into the environment once it looked (an
    import before the engine's): that is not the user's choice, and the engine's cache wins."""
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # as torch does on its first look
    assert vllm_setup.torch_default_inductor_dir(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    vllm_setup.prepare(cache_dir=tmp_path, threads=0, on_cpu=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
