"""Kernel backend "auto" resolving differently across CP ranks (mixed hardware).

"auto" is resolved per process (`kernels.resolve_auto_backend`): fa4 where FlashAttention-4 is installed on a
Hopper GPU, flex / staircase / math elsewhere. With a rank lacking FA4 (or its GPU) the ranks ran different
kernels, or the call raised on some ranks only. `kernels.auto_backend_code` is now part of the agreement row of
`prepare_splitkv_metadata` and of the call without `metadata=` (backend "auto"), and of
`check_environment_agreement(dtype=)` (host-built metadata): every rank raises the same ValueError naming the
backend and the ranks.

CPU, gloo, P = 2: rank 1's availability monkeypatched (`resolve_auto_backend` says "fa4" there, as on a Hopper
GPU with FA4; or "flex").
"""

import torch

from _dist import run_distributed
from _splitkv_helpers import small_inputs


def _worker(rank, world):
    import megatron_splitkv as msk
    import megatron_splitkv.kernels as kernels
    from megatron_splitkv.ops import check_environment_agreement

    x, m = small_inputs(rank)
    kw = dict(block_size=4, num_heads_q=4, num_heads_kv=2, head_dim=8, dtype=torch.float32)

    def attempt(fn):
        try:
            fn()
            return None
        except ValueError as exc:
            return str(exc)

    def plain(backend):
        return lambda: msk.splitkv_attention(*x.values(), *m.values(), block_size=4, backend=backend)

    out = {"agree": attempt(lambda: msk.splitkv_attention(*x.values(), None, None, None, None, backend="auto",
                                                           metadata=msk.prepare_splitkv_metadata(*m.values(), **kw)))}
    real = kernels.resolve_auto_backend
    for kernel in ("fa4", "flex"):
        if rank == 1:  # FA4 on a Hopper GPU (or flex) on this rank only
            kernels.resolve_auto_backend = lambda *a, _k=kernel, **k: _k
        out[kernel, "prepare"] = attempt(lambda: msk.prepare_splitkv_metadata(*m.values(), **kw))
        out[kernel, "env"] = attempt(lambda: check_environment_agreement(dtype=torch.float32, head_dim=8))
        out[kernel, "env without dtype"] = attempt(check_environment_agreement)
        # the calls use an explicit kernel (--splitkv-kernel flex on mixed hardware): no "auto" check, the op runs
        explicit = {}

        def run_explicit():
            meta = msk.prepare_splitkv_metadata(*m.values(), **kw, backend="math")
            explicit["out"] = msk.splitkv_attention(*x.values(), None, None, None, None, backend="math",
                                                    metadata=meta).detach().double()
        out[kernel, "prepare explicit"] = attempt(run_explicit)
        out[kernel, "explicit out"] = "out" in explicit and bool(torch.isfinite(explicit["out"]).all())
        # one rank "auto", the other explicit: a single "auto" resolution agrees with itself
        out[kernel, "prepare one auto"] = attempt(
            lambda: msk.prepare_splitkv_metadata(*m.values(), **kw, backend="auto" if rank == 0 else "flex"))
        kernels.resolve_auto_backend = real
    out["prepare bad backend"] = attempt(lambda: msk.prepare_splitkv_metadata(*m.values(), **kw, backend="flash"))
    if rank == 1:
        kernels.resolve_auto_backend = lambda *a, **k: "flex"
    out["plain auto"] = attempt(plain("auto"))
    out["plain math"] = attempt(plain("math"))  # an explicit backend: runs
    kernels.resolve_auto_backend = real
    return out


def test_auto_backend_differing_across_ranks_raises_the_same_error_everywhere():
    res = run_distributed(_worker, 2, timeout=300)
    assert res[0] == res[1]  # the same messages on every rank
    out = res[0]
    assert out["agree"] is None and out["plain math"] is None
    for kernel in ("fa4", "flex"):
        assert out[kernel, "env without dtype"] is None
        assert out[kernel, "prepare explicit"] is None and out[kernel, "prepare one auto"] is None
        assert out[kernel, "explicit out"] is True  # ran, finite
        for what, name in (("prepare", "prepare_splitkv_metadata"), ("env", "check_environment_agreement")):
            msg = out[kernel, what]
            assert msg is not None and msg.startswith(f"{name}: kernel backend 'auto' must resolve to the same "
                                                      "kernel on every CP rank"), msg
            assert f"'math' on CP rank 0; '{kernel}' on CP rank 1" in msg, msg
    msg = out["prepare bad backend"]
    assert msg is not None and "backend must be 'auto' or one of" in msg and "'flash'" in msg, msg
    msg = out["plain auto"]
    assert msg is not None and msg.startswith("splitkv: kernel backend 'auto'"), msg
    assert "'math' on CP rank 0; 'flex' on CP rank 1" in msg, msg


def _mixed_backend_worker(rank, world):
    """Ranks 0 and 1 call with backend "auto", rank 2 with "math"; rank 1's "auto" resolves to flex (mixed
    hardware). Then rank 0 "auto", ranks 1 and 2 "math" (rank 1's "auto" still flex, but unused there)."""
    import megatron_splitkv as msk
    import megatron_splitkv.kernels as kernels

    x, m = small_inputs(rank)
    if rank == 1:
        kernels.resolve_auto_backend = lambda *a, **k: "flex"
    out = {}
    for job, autos in (("two auto ranks differ", (0, 1)), ("one auto rank", (0,))):
        try:
            o = msk.splitkv_attention(*x.values(), *m.values(), block_size=4,
                                      backend="auto" if rank in autos else "math")
            out[job] = ("ran", o.detach().double())
        except ValueError as exc:
            out[job] = ("raised", str(exc))
    return out


def test_auto_check_does_not_depend_on_this_ranks_backend():
    """The call without metadata= checked "auto"'s agreement only on the ranks that passed backend="auto": with
    some ranks on an explicit backend those raised alone and the others waited in the data collectives (hang).
    Every rank now sends whether it uses "auto" and the check runs on every rank over the ranks that do: the same
    ValueError everywhere when they differ; one "auto" rank among explicit ones has nothing to disagree with
    (as before: an explicit backend is the caller's) and runs, with the same output as an all-"math" call."""
    res = run_distributed(_mixed_backend_worker, 3, timeout=120)
    kinds = {r["two auto ranks differ"][0] for r in res}
    assert kinds == {"raised"}, [r["two auto ranks differ"] for r in res]
    msgs = {r["two auto ranks differ"][1] for r in res}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert msg.startswith("splitkv: kernel backend 'auto'") and "'math' on CP rank 0; 'flex' on CP rank 1" in msg, msg
    assert "rank 2" not in msg, msg  # rank 2 passed "math": not part of "auto"'s agreement
    assert all(r["one auto rank"][0] == "ran" for r in res), [r["one auto rank"][0] for r in res]
