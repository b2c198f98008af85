"""DFlash TransformerBlock built from the Split-KV spec: TP x CP and PP x CP equal the same model at CP=1.

Every comparison is against a single-process float64 run of the same block (TP=CP=PP=1), which itself
is checked against an independent functional float64 reference (megatron_splitkv.reference). CPU, gloo.
Case C7 (GQA heads under TP x CP): the TP shards' q -> kv head mapping, and a head count TP does not divide.
"""

import math

import pytest
import torch

from _dist import run_distributed

megatron = pytest.importorskip("megatron.core")

B = 4  # block size


# ------------------------------------------------------------------------------------------------
# Problem construction (shared by all tests in this file)
# ------------------------------------------------------------------------------------------------


def make_problem(*, hidden, heads, groups, kv_channels, ffn, num_layers, seed=0, n_blocks=8):
    """Full (unsharded) weights, inputs and metadata, float64."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).contiguous()

    D = kv_channels
    state = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)
        state[p + "self_attention.linear_q.weight"] = rnd(heads * D, hidden, scale=hidden**-0.5)
        state[p + "self_attention.linear_kv.weight"] = rnd(2 * groups * D, hidden, scale=hidden**-0.5)
        state[p + "self_attention.q_layernorm.weight"] = 1 + rnd(D, scale=0.1)
        state[p + "self_attention.k_layernorm.weight"] = 1 + rnd(D, scale=0.1)
        state[p + "self_attention.linear_proj.weight"] = rnd(hidden, heads * D, scale=(heads * D) ** -0.5)
        state[p + "pre_mlp_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)
        state[p + "mlp.linear_fc1.weight"] = rnd(2 * ffn, hidden, scale=hidden**-0.5)
        state[p + "mlp.linear_fc2.weight"] = rnd(hidden, ffn, scale=ffn**-0.5)
    state["final_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)

    seq_lens = [11, 9]
    kv_seq = torch.cat([torch.full((n,), j, dtype=torch.int64) for j, n in enumerate(seq_lens)])
    kv_pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens])
    # blocks: (seq, anchor); anchor 0 sees no context; -1 = invalid block
    blocks = [(0, 3), (0, 0), (1, 5), (0, 10), (1, 8), (1, -1), (0, 6), (1, 2)][:n_blocks]
    q_seq = torch.tensor([s for s, _ in blocks], dtype=torch.int64)
    q_anchor = torch.tensor([a for _, a in blocks], dtype=torch.int64)
    tk = kv_seq.numel()
    data = {
        "h": rnd(n_blocks * B, 1, hidden),
        "ctx": rnd(tk, 1, hidden),
        "w_out": rnd(n_blocks * B, 1, hidden),  # loss = sum(out * w_out)
        "q_seq": q_seq,
        "q_anchor": q_anchor,
        "kv_seq": kv_seq,
        "kv_pos": kv_pos,
        # a scrambled, uneven context assignment (exercises global positions)
        "ctx_perm": torch.randperm(tk, generator=g),
    }
    cfg = dict(hidden=hidden, heads=heads, groups=groups, kv_channels=kv_channels, ffn=ffn, num_layers=num_layers)
    return cfg, state, data


def ctx_indices(data, cp, r):
    """Context token indices held by CP rank r: uneven, non-contiguous split of a permutation."""
    perm = data["ctx_perm"]
    tk = perm.numel()
    if cp == 1:
        return torch.arange(tk)
    # uneven cut points: rank r gets roughly (r + 1) shares
    shares = torch.tensor([r_ + 1 for r_ in range(cp)], dtype=torch.float64)
    cuts = torch.cat([torch.zeros(1), torch.cumsum(shares, 0) / shares.sum() * tk]).round().long()
    return perm[cuts[r] : cuts[r + 1]].sort().values.flip(0)  # reversed order on purpose


def shard_param(key, full, tp, r):
    """Slice of a full (TP=1) parameter held by TP rank r (Megatron's layouts)."""
    if tp == 1:
        return full
    if key.endswith(("linear_q.weight", "linear_kv.weight")):
        return full.chunk(tp, 0)[r]
    if key.endswith("linear_fc1.weight"):  # gated: [gate; up] -> [gate_r; up_r]
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, 1)[r]
    return full  # norms: replicated


# ------------------------------------------------------------------------------------------------
# Distributed worker
# ------------------------------------------------------------------------------------------------


def _config(cfg, tp, cp, pp, config_tp=None):
    """A Qwen3-style float64 config of the drafter layers (`qwen3_config`: RMSNorm, SwiGLU, qk-norm, no biases)."""
    from megatron_splitkv.megatron.models import qwen3_config

    return qwen3_config(
        num_layers=cfg["num_layers"],
        hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"],
        num_query_groups=cfg["groups"],
        kv_channels=cfg["kv_channels"],
        ffn_hidden_size=cfg["ffn"],
        params_dtype=torch.float64,
        tensor_model_parallel_size=tp if config_tp is None else config_tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float64 if pp > 1 else None,
        perform_initialization=False,
    )


def block_worker(rank, world, tp, cp, pp, cfg, state, data, cp_impls=("splitkv",), fmt="sbhd", layer_attention=None):
    """Build the DFlash block on this rank for each CP implementation in `cp_impls` (per-layer attention kinds
    `layer_attention`, None: all full), run forward/backward, return {impl: local outputs and grads}."""
    from megatron.core import parallel_state as ps

    torch.manual_seed(1234)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        create_gloo_process_groups=False,  # the default group is gloo already
    )
    try:
        out = {impl: _run_block(tp, cp, pp, cfg, state, data, impl, fmt, layer_attention=layer_attention)
               for impl in cp_impls}
        if pp == 1 and layer_attention is None:
            out["cross"] = _run_plain_cross(cfg, data)
        return out
    finally:
        ps.destroy_model_parallel()


def _run_block(tp, cp, pp, cfg, state, data, cp_impl, fmt, dtype=torch.float64, device="cpu", splitkv_config=None,
               layer_attention=None):
    """One forward/backward of this rank's shard of the block (in `dtype` on `device`; the returned
    tensors are float64 on the CPU; `splitkv_config`, `layer_attention`: the layer spec's). Also used by
    tests/nightly/test_megatron_nccl.py (bf16, NCCL)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_splitkv.megatron import DFlashPackedSeqParams, get_dflash_layer_spec

    if True:
        tp_r = ps.get_tensor_model_parallel_rank()
        cp_r = ps.get_context_parallel_rank()
        pp_r = ps.get_pipeline_model_parallel_rank()
        config = _config(cfg, tp, cp, pp)
        spec = get_dflash_layer_spec(cp_impl=cp_impl, use_te=False, rotary_base=10000.0,
                                     splitkv_config=splitkv_config, layer_attention=layer_attention)
        last = pp_r == pp - 1
        block = TransformerBlock(config, spec, post_layer_norm=last, pre_process=True, post_process=last)
        # mcore's torch norms ignore params_dtype (Megatron's Float16Module casts in training)
        block = block.to(device, dtype)
        offset = pp_r * (cfg["num_layers"] // pp)
        local_state = {}
        for k in block.state_dict():
            if k.endswith("_extra_state"):
                continue
            gk = k
            if k.startswith("layers."):
                i = int(k.split(".")[1])
                gk = "layers." + str(i + offset) + k[len("layers." + str(i)):]
            local_state[k] = shard_param(gk, state[gk], tp, tp_r)
        missing = block.load_state_dict(local_state, strict=False)
        assert not [m for m in missing.missing_keys if not m.endswith("_extra_state")], missing
        # this CP rank's data
        nb = data["q_seq"].numel() // cp
        bsl = slice(cp_r * nb, (cp_r + 1) * nb)
        tsl = slice(cp_r * nb * B, (cp_r + 1) * nb * B)
        ci = ctx_indices(data, cp, cp_r)
        params = DFlashPackedSeqParams(
            qkv_format=fmt,
            q_seq=data["q_seq"][bsl].to(device, copy=True),
            q_anchor=data["q_anchor"][bsl].to(device, copy=True),
            kv_seq=data["kv_seq"][ci].to(device, copy=True),
            kv_pos=data["kv_pos"][ci].to(device, copy=True),
            block_size=B,
        )
        ctx = data["ctx"][ci].to(device, dtype, copy=True).requires_grad_(True)
        if pp_r == 0:
            h = data["h"][tsl].to(device, dtype, copy=True).requires_grad_(True)
        else:
            h = torch.empty(data["h"][tsl].shape, dtype=dtype, device=device)
            dist.recv(h, src=ps.get_pipeline_model_parallel_prev_rank())
            h.requires_grad_(True)
        out = block(hidden_states=h, attention_mask=None, context=ctx, packed_seq_params=params)
        if last:
            acc = torch.promote_types(dtype, torch.float32)  # bf16: the loss in fp32
            loss = (out.to(acc) * data["w_out"][tsl].to(device, acc)).sum()
            loss.backward()
        else:
            dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            g = torch.empty_like(out)
            dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank())
            out.backward(g)
        if pp_r > 0:
            dist.send(h.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
        # Megatron reduces parameter gradients over the data-parallel x context-parallel group
        grads = {}
        for k, p in block.named_parameters():
            gk = k
            if k.startswith("layers."):
                i = int(k.split(".")[1])
                gk = "layers." + str(i + offset) + k[len("layers." + str(i)):]
            gr = p.grad.detach().clone()
            if cp > 1:
                dist.all_reduce(gr, group=ps.get_context_parallel_group())
            if tp > 1 and ("q_layernorm" in k or "k_layernorm" in k):
                # finalize_model_grads sums qk-layernorm grads over TP (config.qk_layernorm)
                dist.all_reduce(gr, group=ps.get_tensor_model_parallel_group())
            grads[gk] = gr.double().cpu()
        return {
            "tp": tp_r, "cp": cp_r, "pp": pp_r, "last": last,
            "out": out.detach().double().cpu() if last else None,
            "h_grad": h.grad.detach().double().cpu() if pp_r == 0 else None,
            "ctx_idx": ci, "ctx_grad": ctx.grad.detach().double().cpu(),
            "grads": grads, "n_metadata": len(params._op_metadata),
        }


def cross_inputs(data, heads=4, d=8):
    """Plain cross-attention inputs: q [sq=8, b=2, H, d], k/v [sk=12, b=2, H, d], key-padding mask."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(8, 2, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(12, 2, heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(12, 2, heads, d, generator=g, dtype=torch.float64)
    w = torch.randn(8, 2, heads * d, generator=g, dtype=torch.float64)
    masked = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
    masked[1, 0, 0, 7:] = True  # sample 1: keys 7.. are padding (rank 1 holds only padding of sample 1)
    return q, k, v, w, masked


def _run_plain_cross(cfg, data):
    """Megatron CrossAttention's core-attention call on SplitKVCoreAttention, sequence-sharded over CP."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_splitkv.megatron import splitkv_core_attention

    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    config = _config(cfg, ps.get_tensor_model_parallel_world_size(), cp, 1)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    core = splitkv_core_attention("splitkv")(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="cross",
        cp_comm_type=None, softmax_scale=None, pg_collection=pgs,
    )
    q, k, v, w, masked = cross_inputs(data)
    qs, ks = q.shape[0] // cp, k.shape[0] // cp
    ql = q[r * qs : (r + 1) * qs].clone().requires_grad_(True)
    kl = k[r * ks : (r + 1) * ks].clone().requires_grad_(True)
    vl = v[r * ks : (r + 1) * ks].clone().requires_grad_(True)
    out = core(ql, kl, vl, masked[..., r * ks : (r + 1) * ks], attn_mask_type=AttnMaskType.padding,
               attention_bias=None, packed_seq_params=None)
    (out * w[r * qs : (r + 1) * qs]).sum().backward()
    return {"cp": r, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def check_plain_cross(results, data, cp):
    q, k, v, w, masked = (t.clone() for t in cross_inputs(data))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    s = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(masked, float("-inf"))
    ref = torch.einsum("bhqk,kbhd->qbhd", s.softmax(-1), v).reshape(q.shape[0], q.shape[1], -1)
    (ref * w).sum().backward()
    qs, ks = q.shape[0] // cp, k.shape[0] // cp
    for res in results:
        c, r = res["cross"], res["cross"]["cp"]
        torch.testing.assert_close(c["out"], ref.detach()[r * qs : (r + 1) * qs], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(c["dq"], q.grad[r * qs : (r + 1) * qs], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(c["dk"], k.grad[r * ks : (r + 1) * ks], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(c["dv"], v.grad[r * ks : (r + 1) * ks], rtol=1e-10, atol=1e-10)


def assemble(results, cfg, data, cp, impl="splitkv"):
    """Reassemble per-rank pieces into full tensors (output, dh, dctx, parameter grads)."""
    results = [r[impl] for r in results]
    n_q = data["h"].shape[0]
    out = torch.zeros(n_q, 1, cfg["hidden"], dtype=torch.float64)
    dh = torch.zeros_like(out)
    dctx = torch.zeros_like(data["ctx"])
    tp_max = max(r["tp"] for r in results) + 1
    per_rank_q = n_q // cp
    grads = {}
    seen_ctx = set()
    for r in results:
        tsl = slice(r["cp"] * per_rank_q, (r["cp"] + 1) * per_rank_q)
        if r["last"] and r["tp"] == 0:
            out[tsl] = r["out"]
        if r["h_grad"] is not None and r["tp"] == 0:
            dh[tsl] = r["h_grad"]
        if r["tp"] == 0 and (r["cp"], r["pp"]) not in seen_ctx:
            seen_ctx.add((r["cp"], r["pp"]))
            dctx[r["ctx_idx"]] += r["ctx_grad"]  # ctx feeds every pipeline stage
        for k, g in r["grads"].items():
            grads.setdefault(k, {})[r["tp"]] = g
    return out, dh, dctx, grads, tp_max


def compare(ref, got, cfg, tol=1e-10):
    out_r, dh_r, dctx_r, grads_r, _ = ref
    out, dh, dctx, grads, tp = got
    torch.testing.assert_close(out, out_r, rtol=tol, atol=tol)
    torch.testing.assert_close(dh, dh_r, rtol=tol, atol=tol)
    torch.testing.assert_close(dctx, dctx_r, rtol=tol, atol=tol)
    assert set(grads) == set(grads_r)
    for k in grads_r:
        full = grads_r[k][0]
        for r, g in grads[k].items():
            torch.testing.assert_close(g, shard_param(k, full, tp, r), rtol=tol, atol=tol, msg=lambda m: f"{k}: {m}")
        assert full.abs().sum() > 0 or "q_layernorm" in k, k


# ------------------------------------------------------------------------------------------------
# Independent functional reference for the CP=1 block
# ------------------------------------------------------------------------------------------------


def functional_block(cfg, state, data, base=10000.0, eps=1e-6, layer_attention=None):
    from megatron_splitkv.reference import dflash_attention_reference

    H, G, D = cfg["heads"], cfg["groups"], cfg["kv_channels"]
    state = {k: v.clone().requires_grad_(True) for k, v in state.items()}
    h = data["h"][:, 0].clone().requires_grad_(True)
    ctx = data["ctx"][:, 0].clone().requires_grad_(True)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):
        inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        a = pos.double()[:, None] * inv
        cos, sin = torch.cat([a, a], -1).cos()[:, None], torch.cat([a, a], -1).sin()[:, None]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    q_pos = (data["q_anchor"].clamp(min=0)[:, None] + torch.arange(B)[None]).reshape(-1)
    x = h
    for i in range(cfg["num_layers"]):
        p = lambda n: state[f"layers.{i}.{n}"]  # noqa: E731
        n = rms(x, p("input_layernorm.weight"))
        q = (n @ p("self_attention.linear_q.weight").T).view(-1, H, D)
        kv_c = (ctx @ p("self_attention.linear_kv.weight").T).view(-1, G, 2 * D)
        kv_b = (n @ p("self_attention.linear_kv.weight").T).view(-1, G, 2 * D)
        q = rope(rms(q, p("self_attention.q_layernorm.weight")), q_pos)
        kc = rope(rms(kv_c[..., :D], p("self_attention.k_layernorm.weight")), data["kv_pos"])
        kb = rope(rms(kv_b[..., :D], p("self_attention.k_layernorm.weight")), q_pos)
        kind = {} if layer_attention is None else dict(zip(("window", "causal"), layer_attention[i]))
        o, _ = dflash_attention_reference(
            q, kc, kv_c[..., D:], kb, kv_b[..., D:], data["q_seq"], data["q_anchor"], data["kv_seq"],
            data["kv_pos"], block_size=B, **kind,
        )
        x = x + o.reshape(-1, H * D) @ p("self_attention.linear_proj.weight").T
        m = rms(x, p("pre_mlp_layernorm.weight")) @ p("mlp.linear_fc1.weight").T
        gate, up = m.chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ p("mlp.linear_fc2.weight").T
    out = rms(x, state["final_layernorm.weight"])
    (out * data["w_out"][:, 0]).sum().backward()
    return out.detach(), h.grad, ctx.grad, {k: v.grad for k, v in state.items()}


def functional_reference(cfg, state, data, layer_attention=None):
    """`functional_block` in the layout of `assemble` (for `compare`)."""
    out, dh, dctx, grads = functional_block(cfg, state, data, layer_attention=layer_attention)
    return out[:, None], dh[:, None], dctx[:, None], {k: {0: g} for k, g in grads.items()}, 1


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------

SMALL = dict(hidden=32, heads=4, groups=2, kv_channels=8, ffn=32)


@pytest.fixture(scope="module")
def problem():
    return make_problem(num_layers=2, **SMALL)


@pytest.fixture(scope="module")
def reference(problem):
    cfg, state, data = problem
    res = run_distributed(block_worker, 1, 1, 1, 1, cfg, state, data, timeout=240)
    return assemble(res, cfg, data, 1)


def test_cp1_block_matches_functional_reference(problem, reference):
    cfg, state, data = problem
    # outputs, input grads and every parameter gradient
    compare(functional_reference(cfg, state, data), reference, cfg)
    out, dh = reference[0], reference[1]
    # invalid block (index 5) sees nothing but its rows still pass through the residual/MLP
    assert torch.isfinite(out).all() and torch.isfinite(dh).all()


def test_tp2_cp2_block_equals_cp1(problem, reference):
    """splitkv, and the two baselines, at TP=2 x CP=2 (one 4-process run)."""
    cfg, state, data = problem
    impls = ("splitkv", "allgather-kv", "ring-kv")
    res = run_distributed(block_worker, 4, 2, 2, 1, cfg, state, data, impls, "sbhd", timeout=300)
    for impl in impls:
        compare(reference, assemble(res, cfg, data, 2, impl), cfg)
    # the same backend under Megatron's plain CrossAttention contract (packed_seq_params=None)
    check_plain_cross(res, data, 2)


def test_pp2_cp2_block_equals_cp1_thd(problem, reference):
    cfg, state, data = problem
    res = run_distributed(block_worker, 4, 1, 2, 2, cfg, state, data, ("splitkv",), "thd", timeout=300)
    compare(reference, assemble(res, cfg, data, 2), cfg)


def test_the_fused_op_is_used():
    import megatron_splitkv
    from megatron_splitkv.megatron import resolve_cp_attention_fn

    assert resolve_cp_attention_fn("splitkv") is megatron_splitkv.splitkv_attention
    assert resolve_cp_attention_fn("allgather-kv") is megatron_splitkv.allgather_kv_attention
    assert resolve_cp_attention_fn("ring-kv") is megatron_splitkv.ring_kv_attention


# ------------------------------------------------------------------------------------------------
# Case C7: head split under TP + CP with grouped-query attention (/work/shared/cases/README.md)
# ------------------------------------------------------------------------------------------------


def test_c7_gqa_tp4_cp2_mapping():
    """Case C7 (H=12, Hkv=4, TP=4, CP=2, 8 ranks): the block equals the single-process model, whose attention uses
    Megatron's grouping q head h -> kv head h // (H / Hkv); so every TP shard maps its local q heads to the right
    local kv head."""
    cfg, state, data = make_problem(hidden=24, heads=12, groups=4, kv_channels=4, ffn=16, num_layers=1, seed=7)
    # float64 single-process functional reference (attention via dflash_attention_reference, whose
    # grouping is q head h -> kv head h // (H / Hkv) = h // 3); the block's CP=1 equivalence to it
    # is test_cp1_block_matches_functional_reference
    ref = functional_reference(cfg, state, data)
    res = run_distributed(block_worker, 8, 4, 2, 1, cfg, state, data, ("splitkv",), "sbhd", timeout=400)
    compare(ref, assemble(res, cfg, data, 2), cfg)


def _bad_gqa_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_splitkv.megatron import get_dflash_layer_spec
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    msgs = {}
    try:
        cfg = dict(hidden=24, heads=12, groups=3, kv_channels=4, ffn=16, num_layers=1)
        for config_tp in (2, 1):
            try:
                config = _config(cfg, 2, 1, 1, config_tp=config_tp)
                TransformerBlock(config, get_dflash_layer_spec("splitkv", use_te=False))
                msgs[config_tp] = "no error"
            except ValueError as e:
                msgs[config_tp] = f"{type(e).__name__}: {e}"
        return msgs
    finally:
        ps.destroy_model_parallel()


def test_c7_gqa_heads_not_divisible_errors_at_construction():
    """H=12, Hkv=3, TP=2: a clear error at construction naming the flag, on every rank, no hang."""
    # config TP=2: TransformerConfig itself rejects it; config TP=1 (config not told about TP, the TP
    # group comes from parallel_state): DFlashAttention's own check fires, naming --num-query-groups.
    # Either way every rank raises at construction (no collective is entered): no hang.
    res = run_distributed(_bad_gqa_worker, 2, timeout=120)
    for msgs in res:
        for config_tp, msg in msgs.items():
            assert msg != "no error", config_tp
            assert "num_query_groups" in msg or "--num-query-groups" in msg, msg
            assert "3" in msg and "2" in msg
        assert "--num-query-groups (3)" in msgs[1] and "--tensor-model-parallel-size (2)" in msgs[1], msgs[1]
