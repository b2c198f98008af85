"""Invalid inputs raise a clear ValueError (naming the argument and the limit) on EVERY rank, never a
hang: the check runs locally, then one tiny all-gather shares the verdict (DESIGN.md section 2).
Each distributed test runs under run_distributed with a timeout, so a hang fails."""

import pytest
import torch

from _dist import run_distributed
from _splitkv_helpers import OPS, case, check, run_local


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
    # the group is still in step afterwards: a valid call on every op is exact
    c = case(7, world_size, dtype="float64")
    return seen, {op: run_local(op, c, rank) for op in OPS}


def test_bad_input_raises_on_every_rank():
    results = run_distributed(_bad_worker, 2, timeout=120)
    (seen0, ok0), (seen1, ok1) = results
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
