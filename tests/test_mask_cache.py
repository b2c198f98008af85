"""`kernels.base.mask_cache`: what a kernel derives from a mask is built once and, on CUDA, a use on another
stream waits for the building stream (Split-KV's head chunks on two kernel lanes share one mask: without the
wait FA4 read tables still being written, an intermittent illegal memory access on the H200, 2026-12-01)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_splitkv.kernels.base import mask_cache


def test_mask_cache_builds_once_and_keeps_foreign_entries():
    mask = SimpleNamespace(lo=torch.zeros(3, dtype=torch.int64))
    calls = []

    def build():
        calls.append(1)
        return torch.arange(4) * len(calls)

    a = mask_cache(mask, "_t", ("k", 1), build)
    b = mask_cache(mask, "_t", ("k", 1), build)
    assert b is a and len(calls) == 1 and torch.equal(a, torch.arange(4))
    c = mask_cache(mask, "_t", ("k", 2), build)  # another key: built again
    assert len(calls) == 2 and torch.equal(c, torch.arange(4) * 2)
    assert "_t_ready" not in mask.__dict__  # CPU: no events
    mask.__dict__["_t"]["host"] = "prebuilt"  # put there by others (host-built tables): returned as it is
    assert mask_cache(mask, "_t", "host", build) == "prebuilt" and len(calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mask_cache_use_on_another_stream_waits_for_the_build():
    """The build's device work sits behind ~0.2 s of GPU sleep on stream 1; stream 2 reads the cached tensor
    right away. Without the event wait stream 2 reads memory not yet written."""
    dev = torch.device("cuda", torch.cuda.current_device())
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    for trial in range(3):
        mask = SimpleNamespace(lo=torch.zeros(3, dtype=torch.int64, device=dev))

        def build():
            torch.cuda._sleep(200_000_000)
            return torch.full((1 << 22,), 7.0 + trial, device=dev)  # another value per trial (reused memory)

        with torch.cuda.stream(s1):
            mask_cache(mask, "_t", 0, build)
        with torch.cuda.stream(s2):
            got = mask_cache(mask, "_t", 0, build).clone()
        torch.cuda.synchronize(dev)
        assert bool((got == 7 + trial).all()), trial
        with torch.cuda.stream(s1):  # the building stream itself: no wait needed, the same value
            assert mask_cache(mask, "_t", 0, build) is mask.__dict__["_t"][0]
