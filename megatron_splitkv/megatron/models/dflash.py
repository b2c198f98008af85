"""The DFlash drafter as a Megatron-Core module (DESIGN.md section 1; DFlash; arXiv 2611.05926).

    ctx  = RMSNorm(fc(cat[h_tap_1, ..., h_tap_n]))          # this CP rank's context tokens
    h    = E[block input ids]                               # frozen target embedding, MASK row included
    h    = DFlash layers(h, ctx, mask metadata)             # Split-KV (or a baseline) over CP
    loss = sum(w * CE(LMHead(norm(h)), labels)) / sum(w)    # frozen target LM head; denominator over
                                                            # every rank holding part of the batch

Only fc, the fused-context norm, the drafter layers and the final norm are trained; the embedding and
the LM head are the target's (vocab-parallel) modules, frozen and shared.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from ...dflash import DFlashLoss, DraftBlocks, dflash_loss
from ..attention import DFlashPackedSeqParams
from ..specs import get_dflash_layer_spec

__all__ = ["DFlashDraftModel"]


class DFlashDraftModel(MegatronModule):
    """DFlash diffusion drafter (block size B) for one pipeline stage holding all drafter layers.

    Args:
        config: drafter `TransformerConfig` (Qwen3-style, e.g. `megatron_splitkv.megatron.models.
            qwen3_config(num_layers=5, ...)`); hidden_size must equal the target's.
        num_taps: number of tapped target layers (fc input is num_taps * hidden).
        word_embeddings: the target's frozen `VocabParallelEmbedding` (`TargetFeatureProvider.
            word_embeddings`); its row `mask_token_id` is the MASK embedding.
        output_layer: the target's frozen `ColumnParallelLinear` LM head (vocab-parallel logits).
        mask_token_id: the reserved MASK token id (an unused row of the target vocabulary).
        block_size: B (default 16). The loss decay is in the blocks' weights (`build_draft_blocks(...,
            gamma=)`), so one batch construction serves every model.
        cp_impl: "splitkv" | "allgather-kv" | "ring-kv" (`get_dflash_layer_spec`); ignored with
            `layer_spec`. layer_spec: override the drafter layer spec.
        pg_collection: tp / cp groups (default: Megatron's parallel_state).
        loss_group: ranks that hold parts of the batch, over which the loss denominator is summed
            (default: the CP group; use the DP x CP group when data parallelism splits the batch).
        rotary_base: RoPE theta (Qwen3: 1e6). kernel_backend: the op's local kernel.
        use_te: Transformer Engine layer spec (True), local (False), or TE when installed and CUDA is
            available (None).
        freeze_shared: set requires_grad False on the shared embedding and LM head (default True).
        overlap_query_gather: Split-KV's query all-gather before the k/v projections
            (`get_dflash_layer_spec`; None = splitkv_config.overlap_q_gather, default on); ignored with
            `layer_spec`.
        splitkv_config: the op's `SplitKVConfig` (None: the defaults; `get_dflash_layer_spec`); ignored with
            `layer_spec`.
        layer_attention: None (every layer full attention, non-causal), or one (window, causal) per drafter
            layer (`megatron_splitkv.layer_types.layer_attention_kinds`, `layer_attention_from_args`): sliding
            window and causal own block per layer, as dflash's `layer_types` / `sliding_window` /
            `is_causal`; kept as `self.layer_attention`, which export writes (with `layer_spec` only that:
            the spec decides what the layers run, so give it the same kinds).

    Forward: see `forward`. Errors: ValueError for mismatched inputs (see `forward`).
    """

    def __init__(self, config: TransformerConfig, *, num_taps: int, word_embeddings: torch.nn.Module,
                 output_layer: torch.nn.Module, mask_token_id: int, block_size: int = 16,
                 cp_impl: str = "splitkv",
                 layer_spec: Optional[ModuleSpec] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, loss_group=None,
                 rotary_base: float = 1e6, kernel_backend: str = "auto", use_te: Optional[bool] = None,
                 freeze_shared: bool = True, overlap_query_gather: Optional[bool] = None,
                 splitkv_config=None, layer_attention=None):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = pg_collection
        self.loss_group = loss_group if loss_group is not None else getattr(pg_collection, "cp", None)
        self.num_taps = int(num_taps)
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(block_size)
        self.layer_attention = None if layer_attention is None else tuple((w, bool(c)) for w, c in layer_attention)
        h = config.hidden_size
        self.fc = torch.nn.Linear(self.num_taps * h, h, bias=False, dtype=config.params_dtype)
        norm_cfg = copy.copy(config)
        norm_cfg.normalization = "RMSNorm"
        self.hidden_norm = WrappedTorchNorm(config=norm_cfg, hidden_size=h, eps=config.layernorm_epsilon)
        if use_te is None and not torch.cuda.is_available():
            use_te = False
        spec = layer_spec or get_dflash_layer_spec(cp_impl, use_te=use_te, rotary_base=rotary_base,
                                                   kernel_backend=kernel_backend,
                                                   overlap_query_gather=overlap_query_gather,
                                                   splitkv_config=splitkv_config,
                                                   layer_attention=layer_attention)
        self.decoder = TransformerBlock(config=config, spec=spec, post_layer_norm=True, pre_process=True,
                                        post_process=True, pg_collection=pg_collection)
        self.word_embeddings = word_embeddings
        self.output_layer = output_layer
        if freeze_shared:
            for p in list(word_embeddings.parameters()) + list(output_layer.parameters()):
                p.requires_grad_(False)

    def set_input_tensor(self, input_tensor):
        """Pipeline hook (single stage only)."""
        self.decoder.set_input_tensor(input_tensor[0] if isinstance(input_tensor, list) else input_tensor)

    def fuse_context(self, context_features: Tensor) -> Tensor:
        """[T_r, num_taps * hidden] tapped target states -> [T_r, hidden] ctx = RMSNorm(fc(x))."""
        if context_features.dim() != 2 or context_features.shape[1] != self.fc.in_features:
            raise ValueError(
                f"context_features must be [T_r, {self.fc.in_features}] (num_taps * hidden), got "
                f"{tuple(context_features.shape)}"
            )
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    def packed_seq_params(self, blocks: DraftBlocks, kv_seq: Tensor, kv_pos: Tensor, *,
                          metadata=None) -> DFlashPackedSeqParams:
        """The per-micro-batch `DFlashPackedSeqParams` that `forward` builds for this batch (int64 copies
        of `blocks.q_seq` / `blocks.q_anchor`, `kv_seq`, `kv_pos` on the model's device).

        metadata: None (default: the first layer prepares the op metadata, `prepare_splitkv_metadata`), or
        this batch's BOUND Split-KV metadata built ahead (`prepare_splitkv_metadata_from_plan(plan, cp_rank,
        ...)` in the data pipeline, `.bind(cp_group, device)` in the step): every layer uses it (no prepare,
        no metadata collective); it must match the layers' shapes (Hq / Hkv per TP rank, head dim, dtype,
        block size, CP group, device: ValueError naming what differs, at the first layer).

        Reuse across calls: `forward(..., packed_seq_params=p)` with the object `p` returned here runs the
        model on that object instead of a new one, so the op metadata cached on it by its first use (the
        first layer's call: `DFlashPackedSeqParams.op_metadata`, i.e. `prepare_splitkv_metadata` and the
        local kernel's mask caches such as the FlexAttention BlockMask) is reused by later calls. Only for
        calls on the SAME batch (same blocks, kv_seq and kv_pos, same CP group): e.g. an A/B of a training
        step with and without its per-step preparation (`tools/step_overhead.py`), or a repeated step. A
        training loop with a new batch per step passes nothing (the default), which prepares afresh.
        """
        dev = self.fc.weight.device
        return DFlashPackedSeqParams(
            q_seq=blocks.q_seq.to(dev, torch.int64), q_anchor=blocks.q_anchor.to(dev, torch.int64),
            kv_seq=kv_seq.to(dev, torch.int64), kv_pos=kv_pos.to(dev, torch.int64),
            block_size=self.block_size, metadata=metadata,
        )

    def forward(self, context_features: Tensor, blocks: DraftBlocks, kv_seq: Tensor, kv_pos: Tensor,
                *, return_logits: bool = False, packed_seq_params: Optional[DFlashPackedSeqParams] = None,
                metadata=None):
        """Drafter loss on this rank's query blocks against this rank's context shard.

        Args:
            context_features: [T_r, num_taps * hidden] tapped target hidden states of this rank's
                context tokens (any dtype; cast to the parameters' dtype), T_r may be 0.
            blocks: this rank's `DraftBlocks` (`build_draft_blocks` on `Plan.query_slice(rank)`): equal
                block counts on every CP rank, block_size B.
            kv_seq, kv_pos: [T_r] int64 sequence ids and GLOBAL positions of the context tokens
                (`shard_batch(...)["kv_seq"/"kv_pos"]`).
            return_logits: also return the vocab-parallel logits [n*B, V/tp] (float32).
            packed_seq_params: None (default: a new `DFlashPackedSeqParams` per call), or the object
                `self.packed_seq_params(blocks, kv_seq, kv_pos)` returned for this same batch, to reuse
                the op metadata cached on it by an earlier call (see `packed_seq_params`). Only its type,
                block size and lengths are checked (no host sync): the caller guarantees it describes
                this batch.
            metadata: this batch's bound Split-KV metadata built ahead (see `packed_seq_params`), or None;
                not together with packed_seq_params (give it to `packed_seq_params(..., metadata=)` then).
        Returns:
            `DFlashLoss` (loss: this rank's share, differentiable; total: the global loss; weight_sum),
            or (DFlashLoss, logits) with return_logits.
        Every rank of the CP and loss groups must call it (collectives inside).
        Errors: ValueError for a block size different from the model's, mismatched lengths, a
        `packed_seq_params` that is not a `DFlashPackedSeqParams` of this block size and these lengths, or
        `metadata` that does not match the layers (`DFlashPackedSeqParams.check_metadata`).
        """
        if blocks.block_size != self.block_size:
            raise ValueError(f"blocks have B={blocks.block_size}, the model B={self.block_size}")
        if kv_seq.shape[0] != context_features.shape[0] or kv_pos.shape[0] != context_features.shape[0]:
            raise ValueError("kv_seq / kv_pos must have one entry per context token")
        dev = self.fc.weight.device
        if packed_seq_params is None:
            params = self.packed_seq_params(blocks, kv_seq, kv_pos, metadata=metadata)
        elif metadata is not None:
            raise ValueError("pass metadata= to model.packed_seq_params(..., metadata=) when you also pass "
                             "packed_seq_params=, not to forward")
        else:
            params = packed_seq_params
            if not isinstance(params, DFlashPackedSeqParams):
                raise ValueError("packed_seq_params must be the DFlashPackedSeqParams of this batch "
                                 f"(model.packed_seq_params(...)), got {type(params).__name__}")
            got = (params.block_size, params.num_blocks, params.num_ctx_tokens)
            want = (self.block_size, int(blocks.q_seq.numel()), int(kv_seq.shape[0]))
            if got != want:
                raise ValueError(f"packed_seq_params describes another batch: (block size, blocks, context "
                                 f"tokens) {got}, this call {want}")
        ctx = self.fuse_context(context_features.to(dev))  # [T_r, H]
        ids = blocks.input_ids.to(dev, torch.int64)
        h = self.word_embeddings(ids[None, :]).transpose(0, 1).contiguous()  # [n*B, 1, H]
        h = self.decoder(hidden_states=h, attention_mask=None, context=ctx[:, None, :],
                         packed_seq_params=params)
        logits, _ = self.output_layer(h)  # [n*B, 1, V/tp]
        labels = blocks.labels.to(dev, torch.int64)
        ce = tensor_parallel.vocab_parallel_cross_entropy(
            logits.float(), labels[:, None], tp_group=self.pg_collection.tp
        )[:, 0]
        out = dflash_loss(ce, blocks.loss_weight.to(dev), self.loss_group)
        return (out, logits[:, 0].float()) if return_logits else out
