"""Integer arguments given as numpy integers, 0-d integer tensors or any other `__index__` type are
accepted everywhere the package takes an int (block_size, head counts, head_dim, num_chunks,
cp_ranks_per_node, cp_rank, anchor counts, data-pipeline counts, Megatron flag values), and behave as the
same Python int; bool and floats are rejected with a ValueError naming the argument and its limit. One
helper does it (`megatron_splitkv._ints.as_int`). References: the float64 single-process attention
(`dflash_attention_reference`), hand-counted anchor candidates, and the same call with Python ints."""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_splitkv import dflash_attention_reference, prepare_splitkv_metadata, splitkv_attention
from megatron_splitkv._ints import as_int
from megatron_splitkv.ops import prepare_splitkv_metadata_from_plan
from megatron_splitkv.ops.metadata import resolve_num_chunks, resolve_ranks_per_node
from megatron_splitkv.planning import plan_context_parallel


class Idx:
    """A user type with __index__ only (no int subclass, no numbers.Integral)."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v

    def __repr__(self):
        return f"Idx({self.v})"


INTS = [np.int64, np.int32, np.uint8, Idx, lambda v: torch.tensor(v)]
INT_IDS = ["np.int64", "np.int32", "np.uint8", "__index__", "tensor0d"]


@pytest.mark.parametrize("cast", INTS, ids=INT_IDS)
def test_as_int_accepts_index_types(cast):
    v = as_int(cast(16), "block_size", minimum=1)
    assert v == 16 and type(v) is int


@pytest.mark.parametrize("bad", [True, np.bool_(True), torch.tensor(True), 16.0, np.float64(16), "16", None,
                                 torch.tensor(16.0), torch.tensor([16])],
                         ids=["bool", "np.bool_", "booltensor", "float", "np.float64", "str", "None", "floattensor",
                              "1-d tensor"])
def test_as_int_rejects_bool_float_str(bad):
    with pytest.raises(ValueError, match=r"^head_dim must be a positive int, got "):
        as_int(bad, "head_dim", minimum=1)


def test_as_int_limits_named():
    with pytest.raises(ValueError, match=r"^cp_rank must be an int in \[0, 3\], got np.int64\(4\)|"
                                         r"^cp_rank must be an int in \[0, 3\], got 4"):
        as_int(np.int64(4), "cp_rank", minimum=0, maximum=3)
    with pytest.raises(ValueError, match=r"^num_anchors must be an int >= 0, got -1"):
        as_int(-1, "num_anchors", minimum=0)


def _inputs(seed=0):
    """One sequence of 12 tokens, 3 blocks of B = 4 (anchors 2, 7 and a padding block), Hq 4, Hkv 2, D 8."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, D, S = 4, 4, 2, 8, 12
    q_anchor = torch.tensor([2, 7, -1])
    q_seq = torch.tensor([0, 0, 0])
    kv_seq, kv_pos = torch.zeros(S, dtype=torch.int64), torch.arange(S)
    nq = 3 * B
    x = dict(q=torch.randn(nq, Hq, D, generator=g, dtype=torch.float64),
             k_ctx=torch.randn(S, Hkv, D, generator=g, dtype=torch.float64),
             v_ctx=torch.randn(S, Hkv, D, generator=g, dtype=torch.float64),
             k_blk=torch.randn(nq, Hkv, D, generator=g, dtype=torch.float64),
             v_blk=torch.randn(nq, Hkv, D, generator=g, dtype=torch.float64))
    return x, (q_seq, q_anchor, kv_seq, kv_pos), dict(B=B, Hq=Hq, Hkv=Hkv, D=D)


@pytest.mark.parametrize("cast", INTS, ids=INT_IDS)
def test_op_and_metadata_accept_index_types(cast):
    """splitkv_attention (P = 1) with block_size / num_chunks / cp_ranks_per_node and the metadata's head
    counts given as `cast(...)` equals the float64 reference computed with plain ints."""
    x, meta_t, s = _inputs()
    ref, _ = dflash_attention_reference(*x.values(), *meta_t, block_size=s["B"])
    out = splitkv_attention(*x.values(), *meta_t, block_size=cast(s["B"]), backend="math",
                            num_chunks=cast(2), cp_ranks_per_node=cast(1))
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-10, atol=1e-12)
    meta = prepare_splitkv_metadata(*meta_t, block_size=cast(s["B"]), num_heads_q=cast(s["Hq"]),
                                    num_heads_kv=cast(s["Hkv"]), head_dim=cast(s["D"]), dtype=torch.float64,
                                    num_chunks=cast(2))
    assert (type(meta.block_size), type(meta.num_heads_q), type(meta.head_dim)) == (int, int, int)
    out_m = splitkv_attention(*x.values(), metadata=meta, backend="math")
    torch.testing.assert_close(out_m, ref.to(out.dtype), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cast", INTS, ids=INT_IDS)
def test_metadata_from_plan_accepts_index_types(cast):
    plan = plan_context_parallel([13, 7], [[0, 3, 11], [2]], block_size=4, cp_size=2, chunk_size=4)
    ref = prepare_splitkv_metadata_from_plan(plan, 1, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                                             dtype=torch.float32, num_chunks=1, cp_ranks_per_node=2)
    got = prepare_splitkv_metadata_from_plan(plan, cast(1), block_size=cast(4), num_heads_q=cast(4),
                                             num_heads_kv=cast(2), head_dim=cast(8), dtype=torch.float32,
                                             num_chunks=cast(1), cp_ranks_per_node=cast(2))
    for f in ("block_size", "num_heads_q", "num_heads_kv", "head_dim", "num_chunks_requested",
              "cp_ranks_per_node", "n_blocks", "n_ctx"):
        assert getattr(got, f) == getattr(ref, f) and type(getattr(got, f)) is type(getattr(ref, f)), f
    for f in ("q_seq", "q_anchor", "kv_seq", "kv_pos"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@pytest.mark.parametrize("kw,pattern", [
    (dict(block_size=True), r"block_size must be a positive int, got True"),
    (dict(block_size=np.float32(4)), r"block_size must be a positive int, got np.float32\(4.0\)"),
    (dict(num_heads_q=np.int64(0)), r"num_heads_q must be a positive int, got np.int64\(0\)"),
    (dict(head_dim=np.bool_(True)), r"head_dim must be a positive int"),
    (dict(num_chunks=np.int64(-1)), r"num_chunks must be None or a positive int"),
    (dict(cp_ranks_per_node=np.int64(3)), r"cp_ranks_per_node=3 must divide the CP group size P=2"),
])
def test_metadata_rejects_bool_float_and_names_limit(kw, pattern):
    plan = plan_context_parallel([13, 7], [[0, 3, 11], [2]], block_size=4, cp_size=2, chunk_size=4)
    args = dict(block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32)
    args.update(kw)
    with pytest.raises(ValueError, match="^prepare_splitkv_metadata_from_plan: " + pattern):
        prepare_splitkv_metadata_from_plan(plan, 0, **args)


def test_resolvers_accept_index_types():
    assert resolve_num_chunks(np.int64(0), 2, 5) == 1  # 0 = automatic, whatever its integer type
    assert resolve_num_chunks(np.int64(3), 2, 5) == 3 and resolve_num_chunks(Idx(9), 2, 5) == 5
    assert resolve_ranks_per_node(np.int64(2), 4) == 2
    with pytest.raises(ValueError, match="num_chunks must be None or a positive int"):
        resolve_num_chunks(True, 2, 5)
    with pytest.raises(ValueError, match="cp_ranks_per_node must be None or a positive int"):
        resolve_ranks_per_node(2.0, 4)


def test_anchors_and_draft_blocks_accept_index_types():
    from megatron_splitkv.data.anchors import sample_anchors
    from megatron_splitkv.dflash import build_draft_blocks

    # candidates of this mask (loss_mask[a] = loss_mask[a+1] = 1): 1, 2, 5 (counted by hand)
    mask = np.array([0, 1, 1, 1, 0, 1, 1])
    np.testing.assert_array_equal(sample_anchors(mask, np.int64(5), seed=0), [1, 2, 5])
    assert len(sample_anchors(mask, Idx(2), seed=0)) == 2
    for bad in (True, 2.5, 2.0):
        with pytest.raises(ValueError, match=r"num_anchors must be an integer >= 0"):
            sample_anchors(mask, bad, seed=0)
    ids = torch.arange(10, 20)
    ref = build_draft_blocks(ids, [10], torch.tensor([0]), torch.tensor([3]), block_size=4, mask_token_id=99)
    got = build_draft_blocks(ids, [10], torch.tensor([0]), torch.tensor([3]), block_size=Idx(4), mask_token_id=99)
    # block at anchor 3: [x[3], MASK, MASK, MASK] = [13, 99, 99, 99], positions 3..6
    assert got.input_ids.tolist() == [13, 99, 99, 99] and got.position_ids.tolist() == [3, 4, 5, 6]
    for f in dataclasses.fields(ref):
        a, b = getattr(ref, f.name), getattr(got, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    with pytest.raises(ValueError, match=r"block_size must be an int >= 2"):
        build_draft_blocks(ids, [10], torch.tensor([0]), torch.tensor([3]), block_size=True, mask_token_id=99)


def test_pipeline_and_megatron_flag_counts_accept_index_types():
    from megatron_splitkv.data.pipeline import _check_count
    from megatron_splitkv.megatron.arguments import SplitKVArgumentError, _as_int

    assert _check_count(np.int64(2), "num_workers", 0) == 2 and _check_count(Idx(0), "num_workers", 0) == 0
    with pytest.raises(ValueError, match=r"num_workers must be an integer >= 0, got True"):
        _check_count(True, "num_workers", 0)
    assert _as_int(Idx(3), "--dflash-data-workers") == 3
    with pytest.raises(SplitKVArgumentError, match=r"--dflash-data-workers must be an integer, got 1.0"):
        _as_int(1.0, "--dflash-data-workers")
