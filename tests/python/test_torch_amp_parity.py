"""The names a torch.amp user looks for exist in ampkit and answer as torch's do."""

from __future__ import annotations

import pytest
import torch

import ampkit

# torch.amp's public namespace, and the region queries torch keeps at its top level.
TORCH_AMP_NAMES = sorted(n for n in dir(torch.amp) if not n.startswith("_") and callable(getattr(torch.amp, n)))
REGION_QUERIES = ("is_autocast_enabled", "get_autocast_dtype", "is_autocast_cache_enabled")
# Device types torch's autocast knows (on this torch) but ampkit's policies do not describe.
OTHER_DEVICES = [d for d in ("mps", "xpu", "hpu", "xla", "mtia") if torch.amp.is_autocast_available(d)]


@pytest.mark.parametrize("name", TORCH_AMP_NAMES + list(REGION_QUERIES))
def test_ampkit_has_each_torch_amp_name(name):
    assert callable(getattr(ampkit, name, None)), f"ampkit has no {name} (torch.amp has)"
    assert name in ampkit.__all__


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_is_autocast_available_agrees_with_torch_on_the_policy_devices(device):
    assert ampkit.is_autocast_available(device) is torch.amp.is_autocast_available(device)
    ampkit.autocast(device)  # available: a region can be made


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_devices_without_a_policy_are_unavailable_and_refused_with_the_supported_list(device):
    assert torch.amp.is_autocast_available(device)  # torch has an autocast there ...
    assert ampkit.is_autocast_available(device) is False  # ... ampkit has no table
    with pytest.raises(ValueError, match=rf"device type '{device}' is not supported;.*cpu, cuda") as err:
        ampkit.autocast(device)
    assert not isinstance(err.value, ampkit.PolicyError)  # not a complaint about a policy file
    assert not torch.is_autocast_enabled("cpu")  # nothing was entered


def test_unknown_device_strings_raise_as_torch_does():
    with pytest.raises(RuntimeError) as theirs:
        torch.amp.is_autocast_available("tpu")
    with pytest.raises(RuntimeError) as ours:
        ampkit.is_autocast_available("tpu")
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match="device_type must be a string.*got 3"):
        ampkit.is_autocast_available(3)


@pytest.mark.parametrize("cache_enabled", [None, True, False])
def test_is_autocast_cache_enabled_reads_the_region_as_torch_does(cache_enabled):
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
        theirs = torch.is_autocast_cache_enabled()
    with ampkit.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
        ours = ampkit.is_autocast_cache_enabled()
        assert ours == torch.is_autocast_cache_enabled()
    assert ours == theirs
    assert ampkit.is_autocast_cache_enabled() == torch.is_autocast_cache_enabled()
