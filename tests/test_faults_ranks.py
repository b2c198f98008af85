"""One wrong rank: every rank of the CP group raises, within a bounded time, naming the rank and the field.

Fault injection on 2 gloo ranks, rank 1 wrong, in each calling mode of the CP ops: the plain call (no
`metadata=`), `metadata=` prepared with the defaults, and the Megatron core attention
(`SplitKVCoreAttention`). Injected: a wrong tensor shape, a wrong dtype, a different configuration
(softmax_scale, num_chunks, metadata of another step) and, with `metadata=`, rank 1 calling without it.
Every case must raise ValueError on BOTH ranks (a hang fails the test through `run_distributed`'s timeout;
a gloo abort kills the rank and fails it too) with a message that names rank 1 and the field; after the
errors the group is still in step: a correct call equals the float64 reference.

Every worker runs its cases twice in one spawn: with the verdict rows over the CP group (no `check_group`), then
over a gloo `check_group` of the same ranks (a second group; the Megatron layer: the CP group's mirror from
`create_cp_check_groups`). A spy on `torch.distributed.all_gather_into_tensor` shows where the [1, 12] int64
rows went (over the CP group without check_group, over check_group, as CPU tensors, with it, and never over the
CP group then), and `comm_stats` that the op's collectives (names, kinds, bytes) are the same in both runs.
Source: issue 24 item 2, DESIGN.md section 2.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _splitkv_helpers import OPS

from megatron_splitkv import comm_stats, dflash_attention_reference
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


class _RowSpy:
    """Inside the block, every `torch.distributed.all_gather_into_tensor` (the route of every all-gather of
    `megatron_splitkv.comm`) is recorded as (over `check_group`?, shape, dtype, device type)."""

    def __init__(self, check_group):
        self.check_group, self.calls = check_group, []

    def __enter__(self):
        self._orig = orig = dist.all_gather_into_tensor

        def spy(out, inp, group=None, async_op=False):
            over = self.check_group is not None and group is self.check_group
            self.calls.append((over, tuple(inp.shape), inp.dtype, inp.device.type))
            return orig(out, inp, group=group, async_op=async_op)

        dist.all_gather_into_tensor = spy
        return self

    def __exit__(self, *exc):
        dist.all_gather_into_tensor = self._orig

    def rows(self):
        """The verdict rows: (over check_group?, device type) of every [1, 12] int64 all-gather."""
        return [(over, dev) for over, shape, dt, dev in self.calls if shape == (1, 12) and dt == torch.int64]

    def others(self):
        """Every other all-gather: (over check_group?, shape, dtype) (the op's data, the error texts)."""
        return [c[:3] for c in self.calls if not (c[1] == (1, 12) and c[2] == torch.int64)]


def _in_both_modes(rank, cases, make_check_group):
    """`cases(rank, check_group)` (a list of case names and (impl, output) pairs) without a check group, then with
    `make_check_group()`; asserts the spy's and `comm_stats`' view of the two runs (module docstring)."""
    runs = []
    for cg in (None, "make"):
        cg = make_check_group() if cg else None
        with _RowSpy(cg) as spy, comm_stats() as stats:
            seen = cases(rank, cg)
        runs.append((seen, spy, [(r.op, r.kind, r.bytes) for r in stats.records]))
    (plain, spy0, recs0), (checked, spy1, recs1) = runs
    rows0, rows1 = spy0.rows(), spy1.rows()
    assert rows0 and set(rows0) == {(False, "cpu")}, rows0  # the rows exist and, without it, cross the CP group
    assert len(rows1) == len(rows0) and set(rows1) == {(True, "cpu")}, rows1  # all of them over check_group
    # over check_group nothing but the rows and the error texts (uint8); the op's data unchanged, over the CP group
    assert all(dt == torch.uint8 for over, _, dt in spy1.others() if over), spy1.others()
    assert [c for c in spy1.others() if not c[0]] == [c for c in spy0.others() if c[2] != torch.uint8], rank
    assert recs1 == recs0, (rank, recs0, recs1)  # every collective of the ops: same names, kinds, bytes
    return plain + [("check_group", s) if isinstance(s, str) else s for s in checked]


def _check_group_01():
    return dist.new_group([0, 1], backend="gloo")  # a second gloo group over the CP group's ranks


def _each_op(rank, cg):
    """(impl, op, inputs, metadata inputs, check_group keyword) of every op of OPS on `rank` (context 5 + rank)."""
    for impl, op in OPS.items():
        x, m = _inputs(rank, tk=5 + rank)
        yield impl, op, x, m, ({} if cg is None else {"check_group": cg})


def _plain_worker(rank, world_size):
    return _in_both_modes(rank, _plain_cases, _check_group_01)


def _plain_cases(rank, cg):
    seen = []
    for impl, op, x, m, ck in _each_op(rank, cg):
        def call(xx=x, **kw):
            return op(*xx.values(), *m.values(), block_size=B, **ck, **kw)

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
    return _in_both_modes(rank, _metadata_cases, _check_group_01)


def _metadata_cases(rank, cg):
    seen = []
    for impl, op, x, m, ck in _each_op(rank, cg):
        meta = prepare_splitkv_metadata(*m.values(), block_size=B, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
                                        dtype=torch.float32, impl=impl, **ck)  # the defaults: what a layer gets
        # another step's metadata: rank 0's context grew, rank 1's tensors fit both metadata objects
        _, m2 = _inputs(rank, tk=5 + 2 * (1 - rank))
        m2 = m if rank == 1 else m2
        meta2 = prepare_splitkv_metadata(*m2.values(), block_size=B, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
                                         dtype=torch.float32, impl=impl, **ck)

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
            ("rank 1 without metadata=",
             lambda: call() if rank == 0 else op(*x.values(), *m.values(), block_size=B, **ck), "without metadata="),
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
    from megatron_splitkv.megatron import create_cp_check_groups

    # the CP group's gloo mirror, registered for the layer (after the run without it)
    return _in_both_modes(rank, _layer_cases, lambda: create_cp_check_groups(dist.group.WORLD))


def _layer_cases(rank, cg):
    from megatron_splitkv.megatron import DFlashPackedSeqParams, cp_check_group

    assert cp_check_group(dist.group.WORLD) is cg  # what the layer takes: the registered mirror, or none
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
    names = [[s for s in r if not isinstance(s[1], torch.Tensor)] for r in results]
    assert names[0] == names[1] and names[0], names
    assert sum(isinstance(s, tuple) and s[0] == "check_group" for s in names[0]) * 2 == len(names[0]), names[0]
    xs = [_inputs(r, tk=5 + r) for r in range(2)]
    cat = {k: torch.cat([xs[r][0][k] for r in range(2)]).double() for k in xs[0][0]}
    meta = {k: torch.cat([xs[r][1][k] for r in range(2)]) for k in xs[0][1]}
    ref, _ = dflash_attention_reference(*cat.values(), *meta.values(), block_size=B)
    outs = [[s for s in r if isinstance(s[1], torch.Tensor)] for r in results]
    assert len(outs[0]) == len(outs[1]) >= 2, outs  # each mode's "still in step" calls
    for o0, o1 in zip(*outs):
        got = torch.cat([o0[1].reshape(-1, HQ, D), o1[1].reshape(-1, HQ, D)]).double()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_plain_call_one_wrong_rank_raises_everywhere():
    _check(run_distributed(_plain_worker, 2, timeout=TIMEOUT))


def test_metadata_call_one_wrong_rank_raises_everywhere():
    _check(run_distributed(_metadata_worker, 2, timeout=TIMEOUT))


def test_megatron_layer_one_wrong_rank_raises_everywhere():
    pytest.importorskip("megatron.core")
    _check(run_distributed(_layer_worker, 2, timeout=TIMEOUT))
