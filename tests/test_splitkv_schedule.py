"""Split-KV's strategies and its schedule as data (ops/chunking.py, ops/transport.py, ops/schedule.py), on the host.

The records the op really issues are compared with the description in tests/test_splitkv_head_chunks.py (every
rank, rows and heads, flat and two-level) and through `benchlib.predicted_records` in
tests/test_simulate_scaling.py and tests/test_splitkv_hierarchical.py. Here: the chunk layouts, the invariant
that the bytes per collective name do not depend on the chunking, and the errors.
"""

import pytest
import torch

from megatron_splitkv.ops.chunking import HeadChunks, RowChunks, make_chunking
from megatron_splitkv.ops.schedule import describe_splitkv
from megatron_splitkv.ops.transport import FlatAllToAll, TwoLevelAllToAll, make_transport


def _per_name(colls):
    out = {}
    for c in colls:
        out[c.name] = out.get(c.name, 0) + c.bytes
    return out


def test_chunk_layouts():
    rows = make_chunking("rows", 3, 8, 4, 16, 8)
    assert isinstance(rows, RowChunks) and rows.bounds == [(0, 2), (2, 5), (5, 8)]
    assert [rows.segment(c) for c in range(3)] == [(8, 16), (12, 16), (12, 16)]
    heads = make_chunking("heads", 3, 8, 4, 16, 8)  # kv heads 2 / 3 / 3, G = 2
    assert isinstance(heads, HeadChunks)
    assert [heads.heads(c) for c in range(3)] == [(0, 4), (4, 10), (10, 16)]
    assert [heads.kv_heads(c) for c in range(3)] == [(0, 2), (2, 5), (5, 8)]
    assert [heads.segment(c) for c in range(3)] == [(32, 4), (32, 6), (32, 6)]
    with pytest.raises(ValueError, match="chunk_axis"):
        make_chunking("cols", 2, 8, 4, 16, 8)


def test_row_sends_pad_and_zero_invalid_rows():
    x = torch.arange(6 * 2 * 3, dtype=torch.float64).view(6, 2, 3)
    x[1] = float("nan")
    valid = torch.tensor([True, False, True, True, True, True])
    rows = RowChunks([(0, 1), (1, 3)], 3, 2, 1)  # B = 3: chunk rows [0, 3), [3, 9) of 9 padded rows
    a, b = rows.sends(x, 9, valid_rows=valid)
    assert a.shape == (3, 2, 3) and b.shape == (6, 2, 3) and a.is_contiguous() and b.is_contiguous()
    assert torch.equal(a[1], torch.zeros(2, 3, dtype=torch.float64)) and torch.equal(a[0], x[0])
    assert torch.equal(b[:3], x[3:]) and bool((b[3:] == 0).all())
    s0, s1 = rows.sends(x[2:], 9, fill=float("-inf"))
    assert torch.equal(s0, x[2:5]) and torch.equal(s1[:1], x[5:]) and bool((s1[1:] == float("-inf")).all())


@pytest.mark.parametrize("P,L", [(1, 1), (2, 1), (8, 1), (8, 2), (16, 4), (64, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_bytes_per_name_independent_of_chunking(P, L, dtype):
    kw = dict(cp_size=P, max_blocks=12, block_size=16, num_heads_q=32, num_heads_kv=8, head_dim=128, dtype=dtype,
              cp_ranks_per_node=L)
    one = _per_name(describe_splitkv(num_chunks=1, **kw))
    for axis in ("rows", "heads"):
        for k in (2, 3, 5):
            colls = describe_splitkv(num_chunks=k, chunk_axis=axis, **kw)
            assert _per_name(colls) == one, (axis, k)
            assert sorted({c.step for c in colls}) == list(range(k))
    two_level = 1 < L < P
    names = set(one)
    assert ("splitkv.fwd.out.intra" in names) == two_level and ("splitkv.fwd.out" in names) == (not two_level)
    assert ("splitkv.bwd.stats" in names) == (not two_level and P < 9)  # fused [dO | stats] gather otherwise
    if P == 1:
        assert set(one.values()) == {0}


def test_message_sizes():
    """bf16, one chunk: Q rows * Hq * D * 2 bytes; [O | lse] with lse (fp32) as 2 bf16 elements per head; the
    two-level stage 2 in fp32 with lse as 1 element."""
    rows, hq, d = 12 * 16, 32, 128
    flat = {c.name: c for c in describe_splitkv(cp_size=8, max_blocks=12, block_size=16, num_heads_q=hq,
                                                num_heads_kv=8, head_dim=d, dtype=torch.bfloat16, num_chunks=1)}
    assert flat["splitkv.fwd.q"].message == rows * hq * d * 2
    assert flat["splitkv.fwd.out"].message == rows * hq * (d + 2) * 2
    assert flat["splitkv.bwd.stats"].message == rows * hq * 2 * 4
    assert flat["splitkv.bwd.dq"].message == rows * hq * d * 2
    two = {c.name: c for c in describe_splitkv(cp_size=16, max_blocks=12, block_size=16, num_heads_q=hq,
                                               num_heads_kv=8, head_dim=d, dtype=torch.bfloat16, num_chunks=1,
                                               cp_ranks_per_node=4)}
    assert two["splitkv.fwd.out.intra"].message == 4 * rows * hq * (d + 2) * 2
    assert two["splitkv.fwd.out.intra"].group_size == 4 and two["splitkv.fwd.out.inter"].group_size == 4
    assert two["splitkv.fwd.out.inter"].message == rows * hq * (d + 1) * 4
    assert two["splitkv.bwd.dout"].message == rows * hq * (d + 4) * 2  # delta and lse: 2 fp32 = 4 bf16


def test_transport_choice_and_errors():
    assert type(make_transport(8, 1)) is FlatAllToAll and type(make_transport(8, 8)) is FlatAllToAll
    t = make_transport(8, 2)
    assert isinstance(t, TwoLevelAllToAll) and (t.nodes, t.per_node, t.partials) == (4, 2, 4)
    with pytest.raises(ValueError, match="cp_ranks_per_node"):
        describe_splitkv(cp_size=8, max_blocks=4, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                         dtype=torch.float32, cp_ranks_per_node=3)
    with pytest.raises(ValueError, match="num_chunks"):
        describe_splitkv(cp_size=8, max_blocks=4, block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8,
                         dtype=torch.float32, num_chunks=-1)
