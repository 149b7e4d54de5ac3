"""`check_device`: a device this machine's torch cannot use is refused at config time, naming
the field and the fix; the hub's learner config and the peer's config both use it."""

from __future__ import annotations

import pytest
import torch

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.peer.config import PeerConfig
from echo2p2p.policy.devices import check_device

no_cuda = pytest.mark.skipif(torch.cuda.device_count() > 0, reason="CUDA is usable here")


def test_cpu_and_torch_devices_pass():
    check_device("cpu")
    with pytest.raises(ConfigError, match="got 'gpu0'") as info:
        check_device("gpu0")
    assert info.value.field == "device"


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_the_fix(device):
    with pytest.raises(ConfigError, match="--device cpu") as info:
        check_device(device)
    assert info.value.field == "device"


@no_cuda
def test_both_configs_check_it():
    """The hub's learner and a rollout peer refuse it; a relay peer runs no model."""
    for make in (lambda: HubConfig.from_flat(device="cuda"),
                 lambda: PeerConfig(device="cuda")):
        with pytest.raises(ConfigError, match="not compiled with CUDA"):
            make()
    assert PeerConfig(engine="relay", device="cuda").device == "cuda"
