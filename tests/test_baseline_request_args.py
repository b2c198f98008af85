"""`prepare_splitkv_metadata`'s Split-KV request arguments (num_chunks, cp_ranks_per_node) and
their environment variables with the baseline impls ("allgather-kv", "ring-kv"): the baselines do not use
them, but a malformed value is the same ValueError (naming the argument or the variable, and the limit) as
with impl "splitkv", on every rank of the group; a valid value is ignored (docstring of
`prepare_splitkv_metadata`, Args and Raises). The baseline ops called without `metadata=` check the
variables the same way. Before, any value was silently ignored by the baselines.
"""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import small_inputs
from megatron_splitkv.ops.metadata import NUM_CHUNKS_ENV, RANKS_PER_NODE_ENV

IMPLS = ("allgather-kv", "ring-kv", "allgather_kv", "ring_kv", "splitkv")
BAD_ARGS = [
    ("num_chunks", 0, "num_chunks must be None or a positive int, got 0"),
    ("num_chunks", -1, "num_chunks must be None or a positive int, got -1"),
    ("num_chunks", "x", "num_chunks must be None or a positive int, got 'x'"),
    ("num_chunks", 2.5, "num_chunks must be None or a positive int, got 2.5"),
    ("cp_ranks_per_node", 0, "cp_ranks_per_node must be None or a positive int, got 0"),
    ("cp_ranks_per_node", "x", "cp_ranks_per_node must be None or a positive int, got 'x'"),
]
BAD_ENV = [  # (variable, value, message after "must be ")
    (NUM_CHUNKS_ENV, "x", "a positive int (decimal digits), got 'x'"),
    (NUM_CHUNKS_ENV, "0", "a positive int, got '0'"),
    (NUM_CHUNKS_ENV, "-1", "a positive int, got '-1'"),
    (NUM_CHUNKS_ENV, "2.5", "a positive int (decimal digits), got '2.5'"),
    (RANKS_PER_NODE_ENV, "two", "a positive int (decimal digits), got 'two'"),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (NUM_CHUNKS_ENV, RANKS_PER_NODE_ENV):
        monkeypatch.delenv(var, raising=False)


def _prep(m, impl, **kw):
    return msk.prepare_splitkv_metadata(*m.values(), block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                        dtype=torch.float32, impl=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arg,value,msg", BAD_ARGS)
def test_bad_argument_raises_for_every_impl(impl, arg, value, msg):
    _, m = small_inputs()
    with pytest.raises(ValueError, match="^prepare_splitkv_metadata: " + msg.replace(".", r"\.") + "$"):
        _prep(m, impl, **{arg: value})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("var,value,msg", BAD_ENV)
def test_bad_environment_variable_raises_for_every_impl(impl, var, value, msg, monkeypatch):
    _, m = small_inputs()
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as exc:
        _prep(m, impl)
    assert str(exc.value) == f"prepare_splitkv_metadata: {var} must be {msg}"


@pytest.mark.parametrize("impl", ("allgather-kv", "ring-kv"))
def test_baselines_ignore_valid_values(impl, monkeypatch):
    """A valid request does not change a baseline's metadata (one chunk, L = 1), argument or variable."""
    _, m = small_inputs()
    meta = _prep(m, impl, num_chunks=3, cp_ranks_per_node=2)  # 2 does not divide P=1: unused
    assert (meta.num_chunks, meta.cp_ranks_per_node) == (1, 1)
    monkeypatch.setenv(NUM_CHUNKS_ENV, "2")
    assert _prep(m, impl).num_chunks == 1


def _env_on_one_rank_worker(rank, world, impl):
    """Rank 1 alone has a malformed MEGATRON_SPLITKV_NUM_CHUNKS: every rank must raise its message."""
    import os

    if rank == 1:
        os.environ[NUM_CHUNKS_ENV] = "+x"
    _, m = small_inputs(rank)
    try:
        _prep(m, impl, cp_group=None)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("impl", ("allgather-kv", "ring-kv"))
def test_bad_environment_on_one_rank_raises_on_every_rank(impl):
    msgs = run_distributed(_env_on_one_rank_worker, 2, impl, timeout=300)
    assert msgs[0] == msgs[1], msgs
    assert msgs[0] is not None and f"{NUM_CHUNKS_ENV} must be a positive int (decimal digits), got '+x'" in msgs[0], msgs
    assert "rank 1" in msgs[0], msgs


@pytest.mark.parametrize("op", ("allgather_kv", "ring_kv"))
@pytest.mark.parametrize("var,value,msg", BAD_ENV)
def test_baseline_ops_without_metadata_check_the_variables(op, var, value, msg, monkeypatch):
    """The baseline ops called without `metadata=` read the same variables (and ignore valid values)."""
    x, m = small_inputs()
    fn = getattr(msk, f"{op}_attention")
    ref = fn(*x.values(), *m.values(), block_size=4)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as exc:
        fn(*x.values(), *m.values(), block_size=4)
    assert str(exc.value) == f"{op}: {var} must be {msg}"
    monkeypatch.setenv(var, "2")
    assert torch.equal(fn(*x.values(), *m.values(), block_size=4), ref)
