"""One wrong rank: every rank of the CP group raises, within a bounded time, naming the rank and the field.

Fault injection on 2 gloo ranks, rank 1 wrong, in each calling mode of the CP ops: the plain call (no
`metadata=`), `metadata=` prepared with the defaults, and the Megatron core attention
(`SplitKVCoreAttention`). Injected: a wrong tensor shape, a wrong dtype, a different configuration
(softmax_scale, num_chunks, metadata of another step) and, with `metadata=`, rank 1 calling without it.
Every case must raise ValueError on BOTH ranks (a hang fails the test through `run_distributed`'s timeout;
a gloo abort kills the rank and fails it too) with a message that names rank 1 and the field; after the
errors the group is still in step: a correct call equals the float64 reference. Source: issue 24 item 2,
DESIGN.md section 2.
"""

from types import SimpleNamespace

import pytest
import torch
from _dist import run_distributed
from _splitkv_helpers import OPS

from megatron_splitkv import dflash_attention_reference
from megatron_splitkv.ops import prepare_splitkv_metadata

B, HQ, HKV, D = 4, 4, 2, 8
TIMEOUT = 120  # seconds for a whole worker (its cases run one after the other); a hang fails here


def _inputs(rank, tk, dtype=torch.float32, nb=2):
    """This rank's activations and metadata: nb blocks of B rows, tk context tokens of sequence 0."""
    g = torch.Generator().manual_seed(100 + rank)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    x = dict(q=r(nb * B, HQ, D), k_ctx=r(tk, HKV, D), v_ctx=r(tk, HKV, D), k_blk=r(nb * B, HKV, D),
             v_blk=r(nb * B, HKV, D))
    m = dict(q_seq=torch.zeros(nb, dtype=torch.int64), q_anchor=torch.tensor([2 * rank + 1, 2 * rank + 3]),
             kv_seq=torch.zeros(tk, dtype=torch.int64), kv_pos=torch.arange(tk) + 10 * rank)
    return x, m


def _expect_everywhere(rank, name, fn, *needles):
    """fn() must raise ValueError on this rank, its message naming CP rank 1 and every needle."""
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        assert "rank 1" in msg or "rank(s) [1]" in msg, (name, rank, msg)
        for needle in needles:
            assert needle in msg, (name, rank, needle, msg)
        return name
    raise AssertionError(f"{name}: no ValueError on rank {rank}")


def _wrong_on_1(rank, good, bad):
    return bad if rank == 1 else good


def _plain_worker(rank, world_size):
    seen = []
    for impl, op in OPS.items():
        x, m = _inputs(rank, tk=5 + rank)

        def call(xx=x, **kw):
            return op(*xx.values(), *m.values(), block_size=B, **kw)

        cases = [
            ("Hq on rank 1", lambda: call(_wrong_on_1(rank, x, {**x, "q": x["q"][:, :2]})), "Hq"),
            ("k_blk shape on rank 1", lambda: call(_wrong_on_1(rank, x, {**x, "k_blk": x["k_blk"][:4]})),
             "k_blk.shape"),
            ("dtype on rank 1", lambda: call(_wrong_on_1(rank, x, {k: v.double() for k, v in x.items()})),
             "dtype"),
            ("k_ctx dtype on rank 1", lambda: call(_wrong_on_1(rank, x, {**x, "k_ctx": x["k_ctx"].double()})),
             "k_ctx.dtype"),
            ("softmax_scale on rank 1", lambda: call(softmax_scale=_wrong_on_1(rank, 0.25, 0.5)), "softmax_scale"),
        ]
        if impl == "splitkv":
            cases.append(("num_chunks on rank 1", lambda: call(num_chunks=_wrong_on_1(rank, 1, 2)), "num_chunks"))
        seen += [_expect_everywhere(rank, f"{impl}: {n}", fn, *needles) for n, fn, *needles in cases]
        seen.append((impl, call()))  # still in step
    return seen


def _metadata_worker(rank, world_size):
    seen = []
    for impl, op in OPS.items():
        x, m = _inputs(rank, tk=5 + rank)
        meta = prepare_splitkv_metadata(*m.values(), block_size=B, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
                                        dtype=torch.float32, impl=impl)  # the defaults: what a layer gets
        # another step's metadata: rank 0's context grew, rank 1's tensors fit both metadata objects
        _, m2 = _inputs(rank, tk=5 + 2 * (1 - rank))
        m2 = m if rank == 1 else m2
        meta2 = prepare_splitkv_metadata(*m2.values(), block_size=B, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
                                         dtype=torch.float32, impl=impl)

        def call(xx=x, md=meta, **kw):
            return op(*xx.values(), metadata=md, **kw)

        cases = [
            ("q shape on rank 1", lambda: call(_wrong_on_1(rank, x, {**x, "q": x["q"][:4]})), "q.shape"),
            ("v_ctx shape on rank 1", lambda: call(_wrong_on_1(rank, x, {**x, "v_ctx": x["v_ctx"][:2]})),
             "v_ctx.shape"),
            ("dtype on rank 1", lambda: call(_wrong_on_1(rank, x, {k: v.double() for k, v in x.items()})),
             "q.dtype"),
            ("softmax_scale on rank 1", lambda: call(softmax_scale=_wrong_on_1(rank, 0.25, 0.5)), "softmax_scale"),
            ("another step's metadata on rank 1", lambda: call(md=_wrong_on_1(rank, meta, meta2)),
             "size table"),
            ("rank 1 without metadata=", lambda: call() if rank == 0 else op(*x.values(), *m.values(), block_size=B),
             "without metadata="),
            ("rank 1 passes another op's metadata", lambda: call() if rank == 0 else OPS[
                next(o for o in OPS if o != impl)](*x.values(), metadata=meta), "prepared for impl"),
        ]
        seen += [_expect_everywhere(rank, f"{impl}: {n}", fn, *needles) for n, fn, *needles in cases]
        seen.append((impl, call()))  # still in step
    return seen


def _core():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_splitkv.megatron import splitkv_core_attention

    cfg = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                            kv_channels=D, use_cpu_initialization=True, attention_dropout=0.0)
    pgs = SimpleNamespace(cp=torch.distributed.group.WORLD)
    return splitkv_core_attention("splitkv")(
        config=cfg, layer_number=1, attn_mask_type=AttnMaskType.no_mask, attention_type="cross",
        cp_comm_type=None, softmax_scale=None, pg_collection=pgs)


def _layer_worker(rank, world_size):
    from megatron_splitkv.megatron import DFlashPackedSeqParams

    core = _core()
    x, m = _inputs(rank, tk=5 + rank)
    q = x["q"][:, None]  # thd [t, 1, H, D]; keys [context | block tokens]
    k, v = (torch.cat([x[f"{n}_ctx"], x[f"{n}_blk"]])[:, None] for n in ("k", "v"))

    def params():
        return DFlashPackedSeqParams(qkv_format="thd", block_size=B, **m)

    def call(p, qq=q, kk=k, vv=v):
        return core(qq, kk, vv, None, attn_mask_type=None, attention_bias=None, packed_seq_params=p)

    seen = []
    # the step's first layer: the other rank is in the metadata's prepare
    for n, bad, needles in (("key length on rank 1, first layer", dict(kk=k[:-1], vv=v[:-1]), ("key length",)),
                            ("dtype on rank 1, first layer", dict(qq=q.double(), kk=k.double(), vv=v.double()),
                             ("dtype",))):
        p = params()
        seen.append(_expect_everywhere(rank, n, lambda: call(p, **(bad if rank == 1 else {})), *needles))
    # a later layer: the other rank is in the op's call with the step's metadata
    for n, bad, needles in (("key length on rank 1, later layer", dict(kk=k[:-1], vv=v[:-1]), ("key length",)),
                            ("query tokens on rank 1, later layer", dict(qq=q[:-B], kk=k[:-B], vv=v[:-B]),
                             ("query tokens",)),
                            ("dtype on rank 1, later layer", dict(qq=q.double(), kk=k.double(), vv=v.double()),
                             ("dtype",))):
        p = params()
        call(p)
        seen.append(_expect_everywhere(rank, n, lambda: call(p, **(bad if rank == 1 else {})), *needles))
    seen.append(("layer", call(params())))  # still in step
    return seen


def _check(results):
    names = [[s for s in r if isinstance(s, str)] for r in results]
    assert names[0] == names[1] and names[0], names
    for impl in dict.fromkeys(s[0] for s in results[0] if isinstance(s, tuple)):
        outs = [next(s[1] for s in r if isinstance(s, tuple) and s[0] == impl) for r in results]
        xs = [_inputs(r, tk=5 + r) for r in range(2)]
        cat = {k: torch.cat([xs[r][0][k] for r in range(2)]).double() for k in xs[0][0]}
        meta = {k: torch.cat([xs[r][1][k] for r in range(2)]) for k in xs[0][1]}
        ref, _ = dflash_attention_reference(*cat.values(), *meta.values(), block_size=B)
        got = torch.cat([o.reshape(-1, HQ, D) for o in outs]).double()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_plain_call_one_wrong_rank_raises_everywhere():
    _check(run_distributed(_plain_worker, 2, timeout=TIMEOUT))


def test_metadata_call_one_wrong_rank_raises_everywhere():
    _check(run_distributed(_metadata_worker, 2, timeout=TIMEOUT))


def test_megatron_layer_one_wrong_rank_raises_everywhere():
    pytest.importorskip("megatron.core")
    _check(run_distributed(_layer_worker, 2, timeout=TIMEOUT))
