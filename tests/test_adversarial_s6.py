"""Adversarial tests (session 6): the host-built metadata, the data pipeline and their flags. Each test
pins a defect that was found and fixed; the expected values never come from the code under test."""

import threading

import pytest

from megatron_splitkv.data.pipeline import data_parallel_batches


class _FakeLoader:
    """`ShareGPTLoader`'s interface (set_epoch(epoch, start=), len, iteration from start): n batches an epoch."""

    def __init__(self, n):
        self.n, self.epoch, self.start = n, 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter([(self.epoch, b) for b in range(self.start, self.n)])


def _next_or_hang(gen, timeout=5.0):
    box = {}

    def run():
        try:
            box["value"] = next(gen)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "data_parallel_batches hung (looked for a batch forever)"
    return box


@pytest.mark.parametrize("n, dp, skip", [(1, 2, 0), (1, 2, 3), (2, 3, 0), (3, 4, 1)])
def test_data_parallel_batches_fewer_batches_than_dp_ranks_raises_on_every_rank(n, dp, skip):
    """A loader with fewer batches an epoch than DP ranks: the last DP ranks never got a batch and
    `data_parallel_batches` looped over epochs forever (a hang while the other DP ranks wait for it in the
    all-reduce). Now every DP rank raises the same ValueError naming dp_size."""
    for dpr in range(dp):
        box = _next_or_hang(data_parallel_batches(_FakeLoader(n), dp, dpr, skip))
        assert isinstance(box.get("error"), ValueError), box
        assert "dp_size" in str(box["error"])


def test_data_parallel_batches_enough_batches_still_works():
    for dpr in range(2):
        got = [_next_or_hang(g)["value"] for g in [data_parallel_batches(_FakeLoader(3), 2, dpr)] for _ in range(3)]
        want = [(0, 0), (0, 2), (1, 0)] if dpr == 0 else [(0, 1), (1, 1), (2, 1)]
        assert got == want


@pytest.mark.parametrize("bad", ["cp", 3, object()])
def test_bind_rejects_a_cp_group_that_is_not_a_process_group(bad):
    """`SplitKVMetadata.bind(cp_group=<not a ProcessGroup>)` raised a bare AttributeError / TypeError from
    torch.distributed; its contract is a ValueError prefixed "SplitKVMetadata.bind" naming cp_group."""
    import numpy as np
    import torch

    from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
    from megatron_splitkv.planning import plan_context_parallel

    plan = plan_context_parallel([13], [np.array([0, 3])], block_size=4, cp_size=1, chunk_size=4)
    meta = prepare_splitkv_metadata_from_plan(plan, 0, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                              dtype=torch.float32)
    with pytest.raises(ValueError, match=r"SplitKVMetadata\.bind: cp_group"):
        meta.bind(bad, "cpu")
    assert meta.bind(None, "cpu").bound  # still bindable
