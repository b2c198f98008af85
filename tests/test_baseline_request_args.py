"""`prepare_splitkv_metadata`'s Split-KV request arguments (num_chunks, cp_ranks_per_node) and `config=` with
the baseline impls ("allgather-kv", "ring-kv"): the baselines do not use them, but a malformed value is the
same ValueError (naming the argument and the limit) as with impl "splitkv", on every rank of the group; a valid
value is ignored (docstring of `prepare_splitkv_metadata`, Args and Raises). The baseline ops called without
`metadata=` check them the same way. (A malformed config field cannot be built: tests/test_config.py.)
"""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import small_inputs

IMPLS = ("allgather-kv", "ring-kv", "allgather_kv", "ring_kv", "splitkv")
BAD_ARGS = [
    ("num_chunks", 0, "num_chunks must be None or a positive int, got 0"),
    ("num_chunks", -1, "num_chunks must be None or a positive int, got -1"),
    ("num_chunks", "x", "num_chunks must be None or a positive int, got 'x'"),
    ("num_chunks", 2.5, "num_chunks must be None or a positive int, got 2.5"),
    ("cp_ranks_per_node", 0, "cp_ranks_per_node must be None or a positive int, got 0"),
    ("cp_ranks_per_node", "x", "cp_ranks_per_node must be None or a positive int, got 'x'"),
    ("config", {"num_chunks": 2}, "config must be None or a SplitKVConfig, got dict"),
]


def _prep(m, impl, **kw):
    return msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arg,value,msg", BAD_ARGS)
def test_bad_argument_raises_for_every_impl(impl, arg, value, msg):
    _, m = small_inputs()
    with pytest.raises(ValueError, match="^prepare_splitkv_metadata: " + msg.replace(".", r"\.") + "$"):
        _prep(m, impl, **{arg: value})


@pytest.mark.parametrize("impl", ("allgather-kv", "ring-kv"))
def test_baselines_ignore_valid_values(impl):
    """A valid request does not change a baseline's metadata (one chunk, L = 1), argument or config."""
    _, m = small_inputs()
    meta = _prep(m, impl, num_chunks=3, cp_ranks_per_node=2)  # 2 does not divide P=1: unused
    assert (meta.num_chunks, meta.cp_ranks_per_node) == (1, 1)
    assert _prep(m, impl, config=msk.SplitKVConfig(num_chunks=2, cp_ranks_per_node=2)).num_chunks == 1


def _bad_on_one_rank_worker(rank, world, impl):
    """Rank 1 alone passes a config that is no SplitKVConfig: every rank must raise its message."""
    _, m = small_inputs(rank)
    try:
        _prep(m, impl, cp_group=None, config={"num_chunks": 2} if rank == 1 else None)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("impl", ("allgather-kv", "ring-kv"))
def test_bad_config_on_one_rank_raises_on_every_rank(impl):
    msgs = run_distributed(_bad_on_one_rank_worker, 2, impl, timeout=300)
    assert msgs[0] == msgs[1], msgs
    assert msgs[0] is not None and "config must be None or a SplitKVConfig, got dict" in msgs[0], msgs
    assert "rank 1" in msgs[0], msgs


@pytest.mark.parametrize("op", ("allgather_kv", "ring_kv"))
def test_baseline_ops_without_metadata_check_the_config(op):
    """The baseline ops called without `metadata=` check `config=` (and ignore valid values)."""
    x, m = small_inputs()
    fn = getattr(msk, f"{op}_attention")
    ref = fn(*x.values(), *m.values(), block_size=4)
    with pytest.raises(ValueError) as exc:
        fn(*x.values(), *m.values(), block_size=4, config="num_chunks=2")
    assert str(exc.value) == f"{op}: config must be None or a SplitKVConfig, got str"
    assert torch.equal(fn(*x.values(), *m.values(), block_size=4, config=msk.SplitKVConfig(num_chunks=2)), ref)
