"""The frozen target LLM as an online feature provider for DFlash drafter training (Megatron-Core 0.19).

A Megatron-Core `GPTModel` with a Qwen3-style configuration (RMSNorm, SwiGLU MLP, grouped-query attention,
qk-layernorm, RoPE, no biases), frozen and forward-only. Under context parallelism each CP rank holds an
arbitrary, planner-chosen set of context tokens (`Plan.token_index(rank)`, with GLOBAL positions and
sequence ids). The causal self-attention of the target on that layout is computed exactly by the
package's all-gather-KV op with block_size = 1: every token is a one-token "block" anchored at its own
position, so it sees the context tokens of its sequence with a smaller position plus itself
(DESIGN.md section 1 mask with B = 1 is exactly the causal mask). RoPE uses the global positions.

The provider returns the hidden states of the tapped layers (`megatron_splitkv.dflash.target_layer_ids`)
for this rank's tokens, concatenated per token: [T_r, n_taps * hidden].

Source: DESIGN.md sections 1 (context features) and 4 (Megatron-Core); DFlash; arXiv 2611.05926.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from ...ops import allgather_kv_attention
from ..attention import DFlashPackedSeqParams
from ..check_groups import cp_check_group
from ..layers import apply_rope

__all__ = [
    "CausalCPCoreAttention",
    "SkippedTargetLayer",
    "TargetFeatureProvider",
    "build_target_model",
    "load_target_weights",
    "qwen3_config",
    "target_layer_spec",
    "target_packed_seq_params",
]


#: the TransformerConfig fusion switches `qwen3_config` turns off (plain PyTorch ops on CPU and GPU alike)
_UNFUSED = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
)


def qwen3_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: Optional[int] = None,
    kv_channels: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
    layernorm_epsilon: float = 1e-6,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = True,
    init_method_std: float = 0.02,
    **overrides,
) -> TransformerConfig:
    """A Qwen3-style `TransformerConfig` (RMSNorm, SwiGLU, GQA, qk-layernorm, no biases, no dropout).

    Args:
        num_layers, hidden_size, num_attention_heads: model shape; num_query_groups: kv heads (default:
            no GQA); kv_channels: head dim (default hidden/heads, Qwen3 uses 128); ffn_hidden_size:
            intermediate size (default 3 * hidden). params_dtype: parameter dtype (fp32 on CPU, bf16 on
            GPU). overrides: any other `TransformerConfig` field (e.g. tensor_model_parallel_size).
    Returns: `TransformerConfig`. Errors: as `TransformerConfig.__post_init__`.
    Source: Qwen3 architecture (Qwen3-8B: 36 layers, hidden 4096, 32 q / 8 kv heads, head dim 128).
    """
    kw = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups or num_attention_heads,
        kv_channels=kv_channels,
        ffn_hidden_size=ffn_hidden_size or 3 * hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=layernorm_epsilon,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **dict.fromkeys(_UNFUSED, False),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        init_method_std=init_method_std,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def target_packed_seq_params(kv_seq: Tensor, kv_pos: Tensor) -> DFlashPackedSeqParams:
    """Metadata for the target's causal forward on this rank's tokens: each token is a one-token block
    anchored at its own global position (q_seq = kv_seq, q_anchor = kv_pos, block_size = 1).

    Args: kv_seq, kv_pos: [T_r] int64 sequence ids and global positions of this rank's tokens.
    """
    kv_seq = kv_seq.to(torch.int64)
    kv_pos = kv_pos.to(torch.int64)
    return DFlashPackedSeqParams(q_seq=kv_seq, q_anchor=kv_pos, kv_seq=kv_seq, kv_pos=kv_pos, block_size=1)


class CausalCPCoreAttention(MegatronModule):
    """Exact causal core attention on a planner layout (arbitrary token sets per CP rank).

    Megatron-Core 0.19 core-attention contract: built with `config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection` (+ `rotary_base`, `rotary_percent`,
    `kernel_backend` bound in the spec); called as `forward(query, key, value, attention_mask, *,
    attn_mask_type, attention_bias, packed_seq_params)` with sbhd `[s, 1, H_tp, D]` q/k/v before RoPE
    (the model is built with `position_embedding_type="none"`, so RoPE at the global positions
    `packed_seq_params.kv_pos` happens here). Returns `[s, 1, H_tp * D]` in query's dtype.

    Attention: `megatron_splitkv.allgather_kv_attention(q, k, v, k, v, q_seq=kv_seq, q_anchor=kv_pos,
    kv_seq, kv_pos, block_size=1)`, i.e. token t sees tokens of its sequence at positions < pos(t) on
    every CP rank plus itself: the causal mask, exact under any layout. Context-sized communication is
    fine here: the target runs forward only (no backward collectives). The op's metadata is prepared
    once per micro-batch (`DFlashPackedSeqParams.op_metadata`) and reused by every target layer.

    Errors: ValueError without `packed_seq_params` metadata or with batch > 1; NotImplementedError for
    attention_bias.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type=None, softmax_scale=None,
                 pg_collection: Optional[ProcessGroupCollection] = None, rotary_base: float = 1e6,
                 rotary_percent: float = 1.0, kernel_backend: str = "auto", **unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.rotary_base = rotary_base
        self.rotary_percent = rotary_percent
        self.kernel_backend = kernel_backend
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if attention_bias is not None:
            raise NotImplementedError("CausalCPCoreAttention does not support attention_bias")
        p = packed_seq_params
        if not isinstance(p, DFlashPackedSeqParams):
            raise ValueError("the target's causal CP attention needs packed_seq_params=target_packed_seq_params(...)")
        if query.dim() != 4 or query.shape[1] != 1:
            raise ValueError(f"expected sbhd [s, 1, h, d] (one packed sample), got {tuple(query.shape)}")
        pos = p.kv_pos
        q = apply_rope(query[:, 0], pos, base=self.rotary_base, rotary_percent=self.rotary_percent)
        k = apply_rope(key[:, 0], pos, base=self.rotary_base, rotary_percent=self.rotary_percent)
        v = value[:, 0]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        # the metadata work (gathers, sort, masks) is done by the first layer and reused by the others
        meta = p.op_metadata("allgather-kv", num_heads_q=q.shape[1], num_heads_kv=k.shape[1],
                             head_dim=q.shape[2], dtype=q.dtype, device=q.device, cp_group=self.cp_group,
                             check_group=cp_check_group(self.cp_group))
        out = allgather_kv_attention(q, k, v, k, v, softmax_scale=scale, backend=self.kernel_backend,
                                     metadata=meta)
        return out.reshape(out.shape[0], 1, q.shape[1] * q.shape[2])  # explicit width: a CP rank may hold 0 rows


def target_layer_spec(*, rotary_base: float = 1e6, rotary_percent: float = 1.0,
                      kernel_backend: str = "auto") -> ModuleSpec:
    """Megatron-Core's local GPT layer spec (RMSNorm, qk-layernorm) with `CausalCPCoreAttention`."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=CausalCPCoreAttention,
        params=dict(rotary_base=rotary_base, rotary_percent=rotary_percent, kernel_backend=kernel_backend),
    )
    return spec


class SkippedTargetLayer(MegatronModule, BaseTransformerLayer):
    """Parameter-free stand-in for a target decoder layer that is never run (`build_target_model(...,
    decoder_layers=False)`: offline features, only the embedding and LM head are borrowed).

    Args (from `TransformerBlock`): config, layer_number, and the block's other keywords.
        rng_spec: None (nothing is built), or the real layer's `ModuleSpec`: the layer is built and freed
            at once, only so that the random-number streams advance exactly as for the full model (a
            random-init output layer then equals the full model's for the same seed); peak memory: one
            layer.
    Calling it raises RuntimeError.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1, *, rng_spec=None, **kwargs):
        super().__init__(config=config)
        self.layer_number = layer_number
        if rng_spec is not None:
            layer = build_module(rng_spec, config=config, layer_number=layer_number, **kwargs)
            del layer

    def forward(self, *args, **kwargs):
        raise RuntimeError("this target was built with decoder_layers=False (offline features: only its embedding "
                           "and LM head exist); build it with decoder_layers=True to compute features")


def build_target_model(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int,
                       rotary_base: float = 1e6, pg_collection: Optional[ProcessGroupCollection] = None,
                       kernel_backend: str = "auto", seed: Optional[int] = None, decoder_layers: bool = True,
                       match_random_init: bool = True) -> GPTModel:
    """A frozen Qwen3-style `GPTModel` (random init unless weights are loaded afterwards).

    Args:
        config: from `qwen3_config`. vocab_size: padded vocabulary (must contain the MASK row).
        max_sequence_length: largest position the model is used with (metadata only: RoPE is computed
            at the given positions). rotary_base: RoPE theta (Qwen3: 1e6). pg_collection: tp/cp/pp
            groups (default: Megatron's parallel_state). seed: torch.manual_seed before init.
        decoder_layers: False = only what a drafter borrows (the embedding, the final norm and the
            output layer; `config.num_layers` parameter-free `SkippedTargetLayer`s in `decoder.layers`, so
            layer ids and tap checks stay as for the full model), e.g. with offline features. Memory:
            vocab x hidden x 2 instead of the whole target (Qwen3-8B: ~2.5 GB instead of ~16 GB in bf16).
        match_random_init: with decoder_layers=False, build and free each decoder layer once (one at a
            time) so that the random init of the output layer is bit-identical to the full model's for
            the same seed (needed when the weights are not loaded afterwards, e.g. features extracted
            from a random target); False: no decoder layer is built at all (weights loaded afterwards
            with `load_target_weights`).
    Returns: `GPTModel` in eval mode with every parameter `requires_grad = False`; with
        decoder_layers=False its attribute `splitkv_decoder_layers` is False and it cannot compute
        features (a skipped layer raises RuntimeError when called).
    """
    if seed is not None:
        torch.manual_seed(seed)
    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    spec = target_layer_spec(rotary_base=rotary_base, kernel_backend=kernel_backend)
    if not decoder_layers:
        spec = ModuleSpec(module=SkippedTargetLayer, params={"rng_spec": spec if match_random_init else None})
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="none",
        **kw,
    )
    model.eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    model.splitkv_decoder_layers = bool(decoder_layers)
    return model


# Transformer Engine spec names -> local spec names (TE fuses the pre-norms into the next linear).
_TE_TO_LOCAL = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)


def load_target_weights(model: GPTModel, path: str) -> None:
    """Load frozen target weights into a `build_target_model` model (a full one, or one built with
    decoder_layers=False: then the file's `decoder.layers.*` entries are skipped, everything else is
    loaded strictly).

    Args:
        path: either a torch file (`torch.save` of a GPTModel state dict, or of {"model": state dict})
            whose keys follow Megatron-Core's local or Transformer Engine GPT layer spec (TE's fused
            `layer_norm_weight` keys are renamed; `_extra_state` entries are dropped), or a Megatron
            torch_dist checkpoint directory (`--save` of a GPT run: the iteration named by
            latest_checkpointed_iteration.txt, or an `iter_*` directory itself) saved with the same
            (local) layer spec, loaded through `megatron.core.dist_checkpointing`.
    Raises: FileNotFoundError; RuntimeError listing missing/unexpected keys (strict loading).
    Status: the file path is covered by the CPU tests; the torch_dist path needs a real checkpoint and
    has not been run here.
    """
    if os.path.isfile(path):
        sd = torch.load(path, map_location="cpu", weights_only=False)
        sd = sd.get("model", sd)
        out = {}
        for k, v in sd.items():
            if k.endswith("_extra_state"):
                continue
            for a, b in _TE_TO_LOCAL:
                k = k.replace(a, b)
            out[k] = v
        if not getattr(model, "splitkv_decoder_layers", True):
            out = {k: v for k, v in out.items() if not k.startswith("decoder.layers.")}
        missing, unexpected = model.load_state_dict(out, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"target weights {path}: missing {missing[:8]}, unexpected {unexpected[:8]}")
        return
    if not os.path.isdir(path):
        raise FileNotFoundError(path)
    from megatron.core import dist_checkpointing

    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.exists(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        path = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model"], strict=False)


class TargetFeatureProvider(torch.nn.Module):
    """Online context features: the frozen target's tapped hidden states for this CP rank's tokens.

    Args:
        model: a `GPTModel` from `build_target_model` (pre_process stage; PP is not supported).
        tap_layers: 0-based target layer ids (`megatron_splitkv.dflash.target_layer_ids`). The feature of
            id i is Hugging Face's `hidden_states[i + 1]` (`output_hidden_states=True`; DFlash, vLLM and
            SGLang add the same +1): the output of decoder layer i, and for the last layer (i = n - 1)
            that output after the final norm, as transformers returns it (`tests/test_hf_import.py`).

    `forward(input_ids, kv_seq, kv_pos)`:
        input_ids, kv_seq, kv_pos: [T_r] int64, this rank's context tokens (any order, e.g.
            `shard_batch(...)["input_ids"/"kv_seq"/"kv_pos"]`), GLOBAL positions and sequence ids.
        Returns [T_r, n_taps * hidden] in the model's dtype, no grad. Runs the embedding and layers
        0..max(tap_layers) only (the LM head is not needed; the final norm only for a last-layer tap).
        Every rank of the CP group must call it (collectives inside), including ranks with T_r = 0.
    """

    def __init__(self, model: GPTModel, tap_layers: Sequence[int]):
        super().__init__()
        n = len(model.decoder.layers)
        taps = [int(i) for i in tap_layers]
        if not taps or min(taps) < 0 or max(taps) >= n:
            raise ValueError(f"tap layers {taps} must lie in [0, {n})")
        self.model = model
        self.tap_layers = taps

    @property
    def feature_dim(self) -> int:
        """n_taps * hidden."""
        return len(self.tap_layers) * self.model.config.hidden_size

    @property
    def word_embeddings(self):
        """The target's frozen (vocab-parallel) input embedding (shared with the drafter)."""
        return self.model.embedding.word_embeddings

    @property
    def output_layer(self):
        """The target's frozen (vocab-parallel) LM head (shared with the drafter)."""
        return self.model.output_layer

    @torch.no_grad()
    def forward(self, input_ids: Tensor, kv_seq: Tensor, kv_pos: Tensor) -> Tensor:
        params = target_packed_seq_params(kv_seq, kv_pos)
        h = self.model.embedding(input_ids=input_ids.reshape(1, -1).to(torch.int64), position_ids=None)
        feats = {}
        last = max(self.tap_layers)
        for i, layer in enumerate(self.model.decoder.layers[: last + 1]):
            h, _ = layer(hidden_states=h, attention_mask=None, packed_seq_params=params)
            if i in self.tap_layers:
                feats[i] = self.model.decoder.final_layernorm(h) if i == len(self.model.decoder.layers) - 1 else h
        out = torch.cat([feats[i] for i in self.tap_layers], dim=-1)  # [T_r, 1, n_taps * hidden]
        return out[:, 0]
