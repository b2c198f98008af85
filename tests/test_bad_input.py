"""Invalid inputs raise a clear ValueError (naming the argument and the limit) on EVERY rank, never a
hang: the check runs locally, then one tiny all-gather shares the verdict (DESIGN.md section 2).
Each distributed test runs under run_distributed with a timeout, so a hang fails."""

import pytest
import torch

import megatron_splitkv as msk
from _dist import run_distributed
from _splitkv_helpers import OPS, case, check, run_local, small_inputs


def _args(rank, *, nb=2, B=4, Hq=4, Hkv=2, D=8, tk=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(rank)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(q=r(nb * B, Hq, D), k_ctx=r(tk, Hkv, D), v_ctx=r(tk, Hkv, D), k_blk=r(nb * B, Hkv, D),
                v_blk=r(nb * B, Hkv, D), q_seq=torch.zeros(nb, dtype=torch.int64),
                q_anchor=torch.full((nb,), 3, dtype=torch.int64), kv_seq=torch.zeros(tk, dtype=torch.int64),
                kv_pos=torch.arange(tk), block_size=B)


def _scenarios(rank):
    """(name, kwargs for this rank, substring every rank's message must contain)."""
    a = _args(rank)
    yield "k_blk shape on rank 1", {**a, "k_blk": a["k_blk"][:-1]} if rank == 1 else a, "k_blk.shape"
    yield "v_ctx dtype on rank 0", {**a, "v_ctx": a["v_ctx"].double()} if rank == 0 else a, "v_ctx.dtype"
    yield "Hq % Hkv", _args(rank, Hq=3, Hkv=2), "Hq must be a multiple of Hkv"
    yield "block_size divides Tq", {**_args(rank), "q": a["q"][:6], "k_blk": a["k_blk"][:6],
                                    "v_blk": a["v_blk"][:6]} if rank == 0 else a, "must divide q.shape[0]"
    yield "block_size across ranks", _args(rank, B=4 if rank == 0 else 2), "block_size must be the same"
    yield "dtype across ranks", _args(rank, dtype=torch.float32 if rank == 0 else torch.float64), "dtype"
    yield "head dim across ranks", _args(rank, D=8 if rank == 0 else 4), "head dim D"
    yield "softmax_scale across ranks", {**a, "softmax_scale": 0.25 if rank == 0 else 0.5}, \
        "softmax_scale (resolved) must be the same on every CP rank; got [0.25, 0.5]"
    # None resolves to 1/sqrt(D) = 0.3535...: an explicit other value on one rank differs too
    yield "softmax_scale None vs value", {**a, "softmax_scale": None if rank == 0 else 0.5}, "softmax_scale"
    yield "q_anchor length", {**a, "q_anchor": a["q_anchor"][:1]} if rank == 1 else a, "q_anchor must be"
    yield "kv_pos float", {**a, "kv_pos": a["kv_pos"].float()} if rank == 1 else a, "kv_pos must have an integer"
    yield "q not 3-D", {**a, "q": a["q"][0]} if rank == 0 else a, "q must be a 3-D tensor"
    yield "backend", {**a, "backend": "nope"}, "backend must be one of"


def _bad_worker(rank, world_size):
    """Both distributed tests of this file in one 2-rank group: the scenarios above on every op, then the
    device / dtype / meta cases of BAD_CASES (`_one_rank_worker`), then a valid call per op (still in step)."""
    seen = []
    for op in OPS:
        for name, kw, expect in _scenarios(rank):
            kw = dict(kw)
            args = [kw.pop(k) for k in ("q", "k_ctx", "v_ctx", "k_blk", "v_blk", "q_seq", "q_anchor", "kv_seq",
                                        "kv_pos")]
            try:
                OPS[op](*args, **kw)
            except ValueError as exc:
                assert expect in str(exc), (op, name, str(exc))
                seen.append((op, name, str(exc)))
            else:
                raise AssertionError(f"{op}: {name}: no ValueError on rank {rank}")
    one_rank = _one_rank_worker(rank, world_size, list(BAD_CASES))
    # the group is still in step afterwards: a valid call on every op is exact
    c = case(7, world_size, dtype="float64")
    return dict(seen=seen, ok={op: run_local(op, c, rank) for op in OPS}, one_rank=one_rank)


@pytest.fixture(scope="module")
def bad_input_run():
    return run_distributed(_bad_worker, 2, timeout=120)


def test_bad_input_raises_on_every_rank(bad_input_run):
    (seen0, ok0), (seen1, ok1) = [(r["seen"], r["ok"]) for r in bad_input_run]
    assert [s[:2] for s in seen0] == [s[:2] for s in seen1]
    for (op, name, m0), (_, _, m1) in zip(seen0, seen1):
        assert m0 == m1, f"{op} {name}: ranks raised different messages:\n{m0}\n{m1}"
    print("\n".join(m for _, _, m in seen0[:11]))
    c = case(7, 2, dtype="float64")
    for op in OPS:
        check(op, c, [ok0[op], ok1[op]])


def test_bad_input_single_process():
    a = _args(0, Hq=3, Hkv=2)
    with pytest.raises(ValueError, match=r"splitkv: Hq % Hkv != 0: q has Hq=3 heads and k_ctx Hkv=2"):
        OPS["splitkv"](*[a.pop(k) for k in list(a)[:9]], **a)
    a = _args(0)
    a["q"], a["k_blk"], a["v_blk"] = a["q"][:7], a["k_blk"][:7], a["v_blk"][:7]
    with pytest.raises(ValueError, match=r"block_size=4 must divide q.shape\[0\] \(Tq_local=7\)"):
        OPS["ring_kv"](*[a.pop(k) for k in list(a)[:9]], **a)
    a = _args(0)
    a["q_seq"] = torch.full((2,), 2**31)
    with pytest.raises(ValueError, match=r"q_seq values must lie in"):
        OPS["allgather_kv"](*[a.pop(k) for k in list(a)[:9]], **a)

# ------------------------------------------------------------------ a bad device, dtype or meta tensor on one rank


def _prep_kw(m, **kw):
    d = dict(block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32)
    d.update(kw)
    return dict(m, **d)


def _bad_case(label, rank, bad_rank=1):
    """(call kind, kwargs) of case `label` on `rank` (bad only on bad_rank)."""
    x, m = small_inputs(rank)
    bad = rank == bad_rank
    if label == "device_str":
        return "prep", _prep_kw(m, device="foo" if bad else None)
    if label == "device_cuda":
        return "prep", _prep_kw(m, device="cuda:99" if bad else None)
    if label == "uint64_prep":
        if bad:
            m["kv_pos"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 2 ** 64 - 1], dtype=torch.uint64)
        return "prep", _prep_kw(m)
    if label == "meta_kv_pos":
        if bad:
            m["kv_pos"] = m["kv_pos"].to("meta")
        return "prep", _prep_kw(m)
    if label == "uint64_op":
        if bad:
            m["kv_pos"] = m["kv_pos"].to(torch.uint64)
        return "op", (x, m)
    if label == "meta_q_op":
        if bad:
            x = {k: v.to("meta") for k, v in x.items()}
        return "op", (x, m)
    raise KeyError(label)


BAD_CASES = {  # label -> text the error must contain
    "device_str": "device must be a torch.device or a device string, got 'foo'",
    "device_cuda": "device=cuda:99",
    "uint64_prep": "kv_pos must have a signed integer dtype",
    "meta_kv_pos": "kv_pos must hold data",
    "uint64_op": "kv_pos must have a signed integer dtype",
    "meta_q_op": "q.device must hold data",
}


def _one_rank_worker(rank, world, labels):
    out = []
    for label in labels:
        kind, args = _bad_case(label, rank)
        try:
            if kind == "prep":
                msk.prepare_splitkv_metadata(**args)
            else:
                x, m = args
                msk.splitkv_attention(*x.values(), *m.values(), block_size=4)
            out.append(("ok", ""))
        except Exception as exc:  # noqa: BLE001
            out.append((type(exc).__name__, str(exc)))
    return out


def test_bad_input_on_one_rank_raises_the_same_error_everywhere(bad_input_run):
    """Each bad input on rank 1 only: the same ValueError on both ranks, naming the argument (before the
    fix: a RuntimeError / NotImplementedError on rank 1 alone, rank 0 waiting in the verdict's all-gather;
    uint64: no error at all). The cases run one after the other in one group, so a rank left behind in a
    collective would hang the next case."""
    if torch.cuda.device_count() > 99:
        pytest.skip("cuda:99 exists")
    labels = list(BAD_CASES)
    res = [r["one_rank"] for r in bad_input_run]
    for i, label in enumerate(labels):
        got = [res[r][i] for r in range(2)]
        assert got[0] == got[1], (label, got)
        kind, msg = got[0]
        assert kind == "ValueError" and BAD_CASES[label] in msg and "rank 1" in msg, (label, got)


@pytest.mark.parametrize("label", list(BAD_CASES))
def test_bad_device_dtype_or_meta_single_process(label):
    """The same inputs in a single process: ValueError naming the argument (was RuntimeError "Expected one of
    cpu, cuda, ... device type at start of device string: foo" / "Found no NVIDIA driver" / no error)."""
    if label == "device_cuda" and torch.cuda.device_count() > 99:
        pytest.skip("cuda:99 exists")
    kind, args = _bad_case(label, 0, bad_rank=0)
    with pytest.raises(ValueError, match=BAD_CASES[label].replace("(", r"\(").replace(".", r"\.")):
        if kind == "prep":
            msk.prepare_splitkv_metadata(**args)
        else:
            x, m = args
            msk.splitkv_attention(*x.values(), *m.values(), block_size=4)
