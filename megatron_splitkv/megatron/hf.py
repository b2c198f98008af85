"""Hugging Face Qwen3 <-> Megatron-Core: the Qwen3 key table, the target import and the drafter export.

One table (`TARGET_KEYS`, `DRAFTER_KEYS`, built from `_layer_keys`) maps every Megatron-Core parameter of
the frozen target `GPTModel` (`build_target_model`) and of the `DFlashDraftModel` to its Hugging Face
tensor(s), with how they are fused and which dim is split over tensor parallelism (TP):

    Megatron-Core 0.19 (local spec)                     Hugging Face Qwen3 (per layer i)
    decoder.layers.i.input_layernorm.weight             input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight   self_attn.{q,k,v}_proj.weight   target: per query group g
                                                        [q heads of g | k_g | v_g], groups in order
    decoder.layers.i.self_attention.linear_q.weight     self_attn.q_proj.weight         drafter
    decoder.layers.i.self_attention.linear_kv.weight    self_attn.{k,v}_proj.weight     drafter: per kv head [k_g | v_g]
    decoder.layers.i.self_attention.{q,k}_layernorm     self_attn.{q,k}_norm.weight
    decoder.layers.i.self_attention.linear_proj.weight  self_attn.o_proj.weight         row parallel
    decoder.layers.i.pre_mlp_layernorm.weight           post_attention_layernorm.weight
    decoder.layers.i.mlp.linear_fc1.weight              mlp.{gate,up}_proj.weight       per TP shard [gate_r | up_r]
    decoder.layers.i.mlp.linear_fc2.weight              mlp.down_proj.weight            row parallel

plus, for the target, `embedding.word_embeddings` <- `model.embed_tokens`, `decoder.final_layernorm` <-
`model.norm`, `output_layer` <- `lm_head` (or `model.embed_tokens` when `tie_word_embeddings`), both
vocab-parallel (rows split over TP); for the drafter `fc`, `hidden_norm`, `decoder.final_layernorm` <->
`fc`, `hidden_norm`, `norm` (the DFlash layout: no prefix, no embedding, no LM head). Column-parallel
tensors split their output rows over TP, row-parallel ones their input columns; with the per-group (per
kv head) layouts each TP rank holds whole query groups, so every TP shard is a contiguous slice of each
Hugging Face tensor and the import reads only that slice from disk (`safetensors.safe_open(...).get_slice`).

Megatron-Bridge (megatron-bridge 0.6.2 on PyPI) has this mapping but requires transformers <= 5.12.1 and
megatron-core[dev,mlm] (Transformer Engine, flashinfer): not installable with this project's pins
(transformers 5.15, megatron-core 0.19 CPU), so the table is written here.

Tap convention (DFlash; DESIGN.md section 6): `target_layer_ids` are 0-based decoder layer ids; the feature
of id i is the output of decoder layer i, Hugging Face's `hidden_states[i + 1]` (index 0 is the embedding),
which is what `TargetFeatureProvider` taps.

Public functions:
    read_qwen3_config(path, ...)       config.json of a Qwen3 checkpoint, validated (`HFCheckpointError`)
    load_hf_target(path, ...)          the frozen, TP-sharded target GPTModel with the checkpoint's weights
    load_hf_target_weights(model, path)  the weights into an existing `build_target_model` model
    drafter_hf_state(model)            the drafter's TP shards gathered into DFlash HF tensors (collective)
    export_drafter(model, out, ...)    config.json + model.safetensors of an in-memory drafter
    drafter_export_meta(model, ...)    what a checkpoint stores (under EXPORT_META_KEY) for a later export
    export_checkpoint(load, out, ...)  the same from a checkpoint on disk (demo or Megatron `torch` format)

Source: DESIGN.md sections 1, 4 and 6; transformers' Qwen3 (`modeling_qwen3.py`), z-lab dflash 0.1.0
(`dflash/model.py`: what `DFlashDraftModel.from_pretrained` reads), Megatron-Core 0.19 `attention.py`
(`SelfAttention.get_query_key_value_tensors`: the per-group qkv layout) and `mlp.py` (the fc1 chunk).
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from ..checkpoint import CheckpointError, iteration_dir, read_tracker, resolve_checkpoint, verify_manifest
from ..dflash import target_layer_ids
from ..layer_types import hf_layer_fields, layer_attention_kinds
from .models.target import _TE_TO_LOCAL, build_target_model, qwen3_config

__all__ = [
    "DRAFTER_ARCHITECTURE",
    "EXPORT_META_KEY",
    "HFCheckpointError",
    "KeyMap",
    "Qwen3Shape",
    "drafter_export_meta",
    "drafter_hf_config",
    "drafter_hf_state",
    "drafter_keys",
    "export_checkpoint",
    "export_drafter",
    "load_hf_target",
    "load_hf_target_weights",
    "read_qwen3_config",
    "save_dflash_hf",
    "target_config_from_hf",
    "target_keys",
]

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
#: key of the export metadata (`drafter_hf_config`'s keyword arguments) in a checkpoint's common dict
EXPORT_META_KEY = "dflash_export"
_QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM",)
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint or an export request that cannot be used; the message names the file and
    the field (or tensor) and what was expected."""


# ----------------------------------------------------------------------------------------------- key table
@dataclass(frozen=True)
class KeyMap:
    """One Megatron-Core parameter and its Hugging Face tensor(s).

    megatron: Megatron-Core name; hf: Hugging Face name(s), fused in this order; fuse: "copy" (one
    tensor), "qkv" (per query group [q heads | k | v]), "kv" (per kv head [k | v]) or "gate_up" (per TP
    shard [gate | up]); tp_dim: the Hugging Face tensors' dim split over TP (0: column parallel or vocab
    parallel, 1: row parallel, None: replicated)."""

    megatron: str
    hf: Tuple[str, ...]
    fuse: str
    tp_dim: Optional[int]


def _layer_keys(model: str) -> Tuple[KeyMap, ...]:
    """The per-layer table (names relative to the layer) for `model` "target" or "drafter"."""
    if model == "target":
        attn = (KeyMap("self_attention.linear_qkv.weight",
                       ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 0),)
    else:
        attn = (KeyMap("self_attention.linear_q.weight", ("self_attn.q_proj.weight",), "copy", 0),
                KeyMap("self_attention.linear_kv.weight", ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                       "kv", 0))
    return attn + (
        KeyMap("input_layernorm.weight", ("input_layernorm.weight",), "copy", None),
        KeyMap("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy", None),
        KeyMap("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy", None),
        KeyMap("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy", 1),
        KeyMap("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy", None),
        KeyMap("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0),
        KeyMap("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "copy", 1),
    )


def _expand(layer: Tuple[KeyMap, ...], num_layers: int, hf_prefix: str) -> List[KeyMap]:
    out = []
    for i in range(num_layers):
        for k in layer:
            out.append(KeyMap(f"decoder.layers.{i}.{k.megatron}", tuple(f"{hf_prefix}{i}.{h}" for h in k.hf),
                              k.fuse, k.tp_dim))
    return out


def target_keys(num_layers: int, *, tie_word_embeddings: bool, decoder_layers: bool = True) -> List[KeyMap]:
    """The table of the target `GPTModel` (`build_target_model`) against `Qwen3ForCausalLM`'s tensors.
    decoder_layers=False: only the embedding, the final norm and the LM head."""
    head = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
    keys = [KeyMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", 0),
            KeyMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None),
            KeyMap("output_layer.weight", (head,), "copy", 0)]
    return keys + (_expand(_layer_keys("target"), num_layers, "model.layers.") if decoder_layers else [])


def drafter_keys(num_layers: int) -> List[KeyMap]:
    """The table of `DFlashDraftModel`'s trained parameters against the DFlash Hugging Face layout (the
    shared embedding and LM head are not part of it)."""
    return [KeyMap("fc.weight", ("fc.weight",), "copy", None),
            KeyMap("hidden_norm.weight", ("hidden_norm.weight",), "copy", None),
            KeyMap("decoder.final_layernorm.weight", ("norm.weight",), "copy", None),
            ] + _expand(_layer_keys("drafter"), num_layers, "layers.")


@dataclass(frozen=True)
class Qwen3Shape:
    """Attention / MLP sizes the fusions need: hidden, q heads, kv heads (query groups), head dim, MLP
    intermediate size."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int

    def rows(self, fuse: str) -> Tuple[int, ...]:
        """Full output rows of each Hugging Face piece of a fused tensor."""
        if fuse == "qkv":
            return (self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim)
        if fuse == "kv":
            return (self.groups * self.head_dim, self.groups * self.head_dim)
        if fuse == "gate_up":
            return (self.ffn, self.ffn)
        raise ValueError(fuse)


def _fuse(fuse: str, pieces: Sequence[Tensor], groups: int) -> Tensor:
    """This TP rank's Hugging Face slices -> its Megatron shard (`groups`: query groups on this rank)."""
    if fuse == "copy":
        return pieces[0]
    if fuse == "gate_up":
        return torch.cat(list(pieces), 0)
    h = pieces[0].shape[-1]
    return torch.cat([p.reshape(groups, -1, h) for p in pieces], 1).reshape(-1, h)


def _unfuse(fuse: str, shard: Tensor, rows: Sequence[int], groups: int) -> List[Tensor]:
    """Inverse of `_fuse`: a Megatron shard -> its Hugging Face slices (`rows`: local rows per piece)."""
    if fuse == "copy":
        return [shard]
    if fuse == "gate_up":
        return list(shard.split(list(rows), 0))
    h = shard.shape[-1]
    parts = shard.reshape(groups, -1, h).split([r // groups for r in rows], 1)
    return [p.reshape(-1, h) for p in parts]


# ------------------------------------------------------------------------------------------ config.json
def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise HFCheckpointError(f"{path}: no such file (a Hugging Face checkpoint directory holds config.json "
                                "and *.safetensors, as transformers' save_pretrained writes)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFCheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path}: not a JSON object (got {type(data).__name__})")
    return data


_DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(cfg: dict, f: str, where: str, default=None) -> int:
    v = cfg.get(f)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HFCheckpointError(f"{where}: field {f} must be an integer >= 1, got {v!r}")
    return v


def _positive_float(v, f: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise HFCheckpointError(f"{where}: field {f} must be a finite number > 0, got {v!r}")
    return float(v)


def _rope_theta(cfg: dict, where: str) -> float:
    """rope_theta, from rope_parameters (transformers 5) or the top level; every RoPE field but the default
    one (rope_scaling or rope_parameters naming another rope_type: linear, dynamic, yarn, llama3, ...) is
    refused."""
    theta = cfg.get("rope_theta")
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise HFCheckpointError(f"{where}: field {field} must be an object, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
        if kind != "default" or extra:
            raise HFCheckpointError(f"{where}: field {field} is {rope!r}; only the default RoPE is supported "
                                    "(no rope scaling)")
        theta = rope.get("rope_theta", theta)
    if theta is None:
        raise HFCheckpointError(f"{where}: field rope_theta (or rope_parameters.rope_theta) is missing")
    return _positive_float(theta, "rope_theta", where)


def read_qwen3_config(path: str, *, mask_token_id: Optional[int] = None,
                      drafter_hidden_size: Optional[int] = None, tp_size: int = 1) -> dict:
    """Read and validate `path/config.json` of a Hugging Face Qwen3 checkpoint.

    Returns a dict with hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, rms_norm_eps, rope_theta, vocab_size, max_position_embeddings, tie_word_embeddings,
    dtype (str or None), and "raw" (the whole config.json).
    Checks (each a `HFCheckpointError` naming config.json and the field): a JSON object; model_type "qwen3"
    and architectures naming Qwen3ForCausalLM (or absent; a DFlash drafter's DFlashDraftModel is named as
    such); every needed size an integer >= 1 (not a bool); rms_norm_eps and rope_theta finite > 0;
    max_position_embeddings >= 1; dtype float32 / bfloat16 / float16 (or absent); attention_bias false;
    hidden_act silu; default RoPE in both rope_parameters and rope_scaling; no sliding window;
    `mask_token_id` in [0, vocab_size) ("no room for the mask token"); `drafter_hidden_size` equal to
    hidden_size; num_attention_heads and num_key_value_heads divisible by `tp_size`.
    """
    where = os.path.join(path, "config.json")
    cfg = _read_json(where)
    arch = cfg.get("architectures")
    if isinstance(arch, list) and DRAFTER_ARCHITECTURE in arch:
        raise HFCheckpointError(f"{where}: field architectures is {arch}: a DFlash drafter, not a "
                                "Qwen3ForCausalLM target (pass the target model's directory)")
    if cfg.get("model_type") != "qwen3" or not (
            arch is None or isinstance(arch, list) and any(a in _QWEN3_ARCHITECTURES for a in arch)):
        raise HFCheckpointError(f"{where}: field model_type is {cfg.get('model_type')!r} and architectures "
                                f"{arch}; a Qwen3 checkpoint (model_type 'qwen3', architectures "
                                "['Qwen3ForCausalLM']) is required")
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        _positive_int(cfg, f, where)
    if cfg.get("attention_bias"):
        raise HFCheckpointError(f"{where}: field attention_bias is true; Megatron's Qwen3 target has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(f"{where}: field hidden_act is {cfg['hidden_act']!r}, only 'silu' (SwiGLU) is "
                                "supported")
    if cfg.get("use_sliding_window"):
        raise HFCheckpointError(f"{where}: field use_sliding_window is true; sliding-window targets are not supported")
    dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtype is not None and dtype not in _DTYPES:
        raise HFCheckpointError(f"{where}: field dtype is {dtype!r}; one of {list(_DTYPES)} is supported")
    heads = cfg["num_attention_heads"]
    groups = _positive_int(cfg, "num_key_value_heads", where, heads)
    head_dim = _positive_int(cfg, "head_dim", where, cfg["hidden_size"] // heads or 1)
    if heads % groups:
        raise HFCheckpointError(f"{where}: field num_attention_heads {heads} is not a multiple of "
                                f"num_key_value_heads {groups}")
    for f, v in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        if v % tp_size:
            raise HFCheckpointError(f"{where}: field {f} = {v} is not divisible by the tensor-parallel size "
                                    f"{tp_size}")
    vocab = cfg["vocab_size"]
    if mask_token_id is not None and not 0 <= int(mask_token_id) < vocab:
        raise HFCheckpointError(f"{where}: field vocab_size = {vocab} has no room for the mask token id "
                                f"{mask_token_id} (it must be a row of the target's embedding, < vocab_size)")
    if drafter_hidden_size is not None and int(drafter_hidden_size) != cfg["hidden_size"]:
        raise HFCheckpointError(f"{where}: field hidden_size = {cfg['hidden_size']} differs from the drafter's "
                                f"hidden size {drafter_hidden_size} (the drafter reads the target's hidden "
                                "states and borrows its embedding)")
    return dict(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
                intermediate_size=cfg["intermediate_size"],
                rms_norm_eps=_positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
                rope_theta=_rope_theta(cfg, where), vocab_size=vocab,
                max_position_embeddings=_positive_int(cfg, "max_position_embeddings", where, 32768),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype=dtype, raw=cfg)


def target_config_from_hf(hf: dict, *, params_dtype: torch.dtype = torch.float32, **overrides):
    """A `qwen3_config` TransformerConfig from `read_qwen3_config`'s dict (overrides: any other
    `TransformerConfig` field, e.g. tensor_model_parallel_size, use_cpu_initialization)."""
    return qwen3_config(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
                        kv_channels=hf["head_dim"], ffn_hidden_size=hf["intermediate_size"],
                        layernorm_epsilon=hf["rms_norm_eps"], params_dtype=params_dtype, **overrides)


# ---------------------------------------------------------------------------------------------- import
class _SafetensorsDir:
    """The tensors of a save_pretrained directory (one model.safetensors, or shards listed by
    model.safetensors.index.json), opened lazily: a shard file is opened the first time one of its
    tensors is read, and only the requested slice is read."""

    def __init__(self, path: str):
        from safetensors import safe_open  # the optional extra "hf"

        self._open = safe_open
        self.path = path
        self._handles: Dict[str, Any] = {}
        index = os.path.join(path, _INDEX)
        single = os.path.join(path, _SINGLE)
        if os.path.exists(index):
            self.where = index
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFCheckpointError(f"{index}: field weight_map is missing")
            self.files = {name: os.path.join(path, f) for name, f in weight_map.items()}
            for f in sorted(set(self.files.values())):
                if not os.path.exists(f):
                    raise HFCheckpointError(f"{index}: field weight_map names the shard {os.path.basename(f)}, "
                                            f"which is missing from {path}")
        elif os.path.exists(single):
            self.where = single
            self.files = {name: single for name in self._handle(single).keys()}
        else:
            found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
            raise HFCheckpointError(f"{path}: neither {_SINGLE} nor {_INDEX} (safetensors files found: {found})")
    def _handle(self, file: str):
        """The open safetensors file; a damaged one (empty, truncated, bad header) -> `HFCheckpointError`."""
        if file not in self._handles:
            try:
                self._handles[file] = self._open(file, framework="pt")
            except Exception as exc:  # safetensors' SafetensorError, OSError
                raise HFCheckpointError(f"{file}: not a readable safetensors file (damaged: "
                                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self.files

    def rows(self, name: str) -> int:
        """Size of tensor `name`'s first dimension."""
        if name not in self.files:
            raise HFCheckpointError(f"{self.where}: tensor {name} is missing")
        return self._handle(self.files[name]).get_slice(name).get_shape()[0]

    def read(self, name: str, tp_dim: Optional[int], tp: int, rank: int, padded: Optional[int] = None) -> Tensor:
        """Tensor `name`, or its TP slice `rank` of `tp` along `tp_dim`. padded: the split dim's size after
        zero padding (vocabulary rows), default its size."""
        if name not in self.files:
            raise HFCheckpointError(f"{self.where}: tensor {name} is missing")
        file = self.files[name]
        sl = self._handle(file).get_slice(name)
        if tp_dim is None or tp == 1 and padded is None:
            return self._data(file, name, sl, slice(None))
        size = sl.get_shape()[tp_dim]
        total = padded or size
        if total % tp:
            raise HFCheckpointError(f"{file}: tensor {name} has {size} along dim {tp_dim}, not divisible by the "
                                    f"tensor-parallel size {tp}")
        a, b = rank * total // tp, (rank + 1) * total // tp
        lo, hi = min(a, size), min(b, size)
        part = self._data(file, name, sl, slice(lo, hi) if tp_dim == 0 else (slice(None), slice(lo, hi)))
        if hi - lo < b - a:  # zero rows past the real vocabulary
            pad = list(part.shape)
            pad[tp_dim] = (b - a) - (hi - lo)
            part = torch.cat([part, part.new_zeros(pad)], tp_dim)
        return part


    @staticmethod
    def _data(file: str, name: str, sl, index) -> Tensor:
        try:
            return sl[index]
        except Exception as exc:  # safetensors' SafetensorError: bytes past the file's end
            raise HFCheckpointError(f"{file}: tensor {name} is not readable (damaged: {exc})") from None


def _tp_of(model) -> Tuple[int, int]:
    """(TP size, TP rank) of a Megatron module with `pg_collection`, else of Megatron's parallel_state."""
    g = getattr(getattr(model, "pg_collection", None), "tp", None)
    if g is not None:
        return dist.get_world_size(g), dist.get_rank(g)
    if parallel_state.model_parallel_is_initialized():
        return (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank())
    return 1, 0


def load_hf_target_weights(model, path: str, *, hf: Optional[dict] = None) -> None:
    """Load a Hugging Face Qwen3 checkpoint's weights into a `build_target_model` GPTModel, this TP rank's
    shards only (column / row / vocab parallel splits, fused qkv per query group, [gate | up] per shard; a
    tied checkpoint fills the LM head from `model.embed_tokens`). A model built with
    `decoder_layers=False` gets only the embedding, final norm and LM head.

    Args: model: the GPTModel (TP group from its `pg_collection`); path: the checkpoint directory;
        hf: `read_qwen3_config(path)` when already read.
    Errors: `HFCheckpointError` naming the file and the field or tensor (not Qwen3, missing shard file,
        missing tensor, shape that differs from the model's, a size not divisible by TP).
    """
    tp, rank = _tp_of(model)
    hf = hf or read_qwen3_config(path, tp_size=tp)
    cfg = model.config
    shape = Qwen3Shape(hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
                       hf["intermediate_size"])
    got = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size,
           cfg.num_layers)
    want = (shape.hidden, shape.heads, shape.groups, shape.head_dim, shape.ffn, hf["num_hidden_layers"])
    if got != want:
        raise HFCheckpointError(f"{os.path.join(path, 'config.json')}: (hidden_size, num_attention_heads, "
                                f"num_key_value_heads, head_dim, intermediate_size, num_hidden_layers) = {want}, "
                                f"the model was built with {got}")
    src = _SafetensorsDir(path)
    layers = getattr(model, "splitkv_decoder_layers", True)
    tied = hf["tie_word_embeddings"]
    params = dict(model.named_parameters())
    vocab_rows = model.embedding.word_embeddings.weight.shape[0] * tp
    for name in ("model.embed_tokens.weight",) + (() if tied else ("lm_head.weight",)):
        if src.has(name) and src.rows(name) != hf["vocab_size"]:
            raise HFCheckpointError(f"{src.files[name]}: tensor {name} has {src.rows(name)} rows, but config.json's "
                                    f"field vocab_size is {hf['vocab_size']}")
    loaded = set()
    with torch.no_grad():
        for k in target_keys(cfg.num_layers, tie_word_embeddings=tied, decoder_layers=layers):
            padded = vocab_rows if k.megatron in ("embedding.word_embeddings.weight", "output_layer.weight") else None
            pieces = [src.read(name, k.tp_dim, tp, rank, padded) for name in k.hf]
            value = _fuse(k.fuse, pieces, shape.groups // tp)
            p = params.get(k.megatron)
            if p is None:
                raise HFCheckpointError(f"the target model has no parameter {k.megatron} (built with another spec?)")
            if tuple(p.shape) != tuple(value.shape):
                raise HFCheckpointError(f"{src.where}: tensor(s) {list(k.hf)} give {k.megatron} the TP shard shape "
                                        f"{tuple(value.shape)}, the model has {tuple(p.shape)}")
            p.copy_(value.to(p.dtype))
            loaded.add(k.megatron)
    left = sorted(set(params) - loaded)
    if left:
        raise HFCheckpointError(f"{src.where}: no Hugging Face tensor for the target's parameters {left[:6]}")


def load_hf_target(path: str, *, pg_collection=None, params_dtype: torch.dtype = torch.float32,
                   mask_token_id: Optional[int] = None, drafter_hidden_size: Optional[int] = None,
                   max_sequence_length: Optional[int] = None, decoder_layers: bool = True,
                   kernel_backend: str = "auto", use_cpu_initialization: bool = True):
    """The frozen target `GPTModel` of a Hugging Face Qwen3 checkpoint directory, TP-sharded.

    Args:
        path: directory with config.json and model.safetensors (or shards + model.safetensors.index.json).
        pg_collection: tp / cp groups (default Megatron's parallel_state). params_dtype: parameter dtype.
        mask_token_id, drafter_hidden_size: checked against config.json's vocab_size / hidden_size.
        max_sequence_length: default config.json's max_position_embeddings.
        decoder_layers: False = only the embedding, final norm and LM head (offline features).
        kernel_backend: the causal attention's local kernel; use_cpu_initialization: as TransformerConfig.
    Returns: `build_target_model(...)` (eval mode, frozen) with the checkpoint's weights; its vocabulary is
        config.json's vocab_size, zero-padded to a multiple of the TP size. Its attribute `hf_config` is
        `read_qwen3_config(path)`. Feed it to `TargetFeatureProvider(model, tap_layers)`: tap id i is Hugging
        Face's `hidden_states[i + 1]`.
    Errors: `HFCheckpointError` (see `read_qwen3_config` and `load_hf_target_weights`).
    """
    tp = dist.get_world_size(pg_collection.tp) if pg_collection is not None else _tp_of(None)[0]
    if getattr(pg_collection, "cp", None) is not None:
        cp = dist.get_world_size(pg_collection.cp)
    else:
        cp = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    hf = read_qwen3_config(path, mask_token_id=mask_token_id, drafter_hidden_size=drafter_hidden_size, tp_size=tp)
    # no random init: every parameter is overwritten by the checkpoint (load_hf_target_weights checks it)
    cfg = target_config_from_hf(hf, params_dtype=params_dtype, tensor_model_parallel_size=tp,
                                context_parallel_size=cp, use_cpu_initialization=use_cpu_initialization,
                                perform_initialization=False)
    vocab = -(-hf["vocab_size"] // tp) * tp
    model = build_target_model(cfg, vocab_size=vocab, rotary_base=hf["rope_theta"],
                               max_sequence_length=max_sequence_length or hf["max_position_embeddings"],
                               pg_collection=pg_collection, kernel_backend=kernel_backend,
                               decoder_layers=decoder_layers, match_random_init=False)
    load_hf_target_weights(model, path, hf=hf)
    model.hf_config = hf
    return model


# ---------------------------------------------------------------------------------------------- export
def _local_key(k: str) -> str:
    """A Transformer Engine spec name -> the local spec name (`module.` wrapper prefix dropped)."""
    if k.startswith("module."):
        k = k[len("module."):]
    for a, b in _TE_TO_LOCAL:
        k = k.replace(a, b)
    return k


_SHARED_PREFIXES = ("word_embeddings.", "output_layer.")


def _drafter_shape(shards: Sequence[Dict[str, Tensor]], where: str) -> Tuple[Qwen3Shape, int]:
    """(sizes, number of layers) of a drafter from its TP shards (Megatron names)."""
    tp = len(shards)
    s = shards[0]
    try:
        hidden = s["fc.weight"].shape[0]
        head_dim = s["decoder.layers.0.self_attention.q_layernorm.weight"].shape[0]
        heads = s["decoder.layers.0.self_attention.linear_q.weight"].shape[0] * tp // head_dim
        groups = s["decoder.layers.0.self_attention.linear_kv.weight"].shape[0] * tp // (2 * head_dim)
        ffn = s["decoder.layers.0.mlp.linear_fc1.weight"].shape[0] * tp // 2
    except KeyError as exc:
        raise HFCheckpointError(f"{where}: the drafter has no parameter {exc.args[0]}; the DFlash layout needs "
                                "q/k layernorms, separate q and kv projections and a gated MLP") from None
    layers = 1 + max(int(k.split(".")[2]) for k in s if k.startswith("decoder.layers."))
    return Qwen3Shape(hidden, heads, groups, head_dim, ffn), layers


def _drafter_shards_to_hf(shards: Sequence[Dict[str, Tensor]], where: str) -> Tuple[Dict[str, Tensor], Qwen3Shape, int]:
    """Per-TP-rank drafter state dicts (Megatron names, local or TE spec) -> the DFlash Hugging Face tensors
    (contiguous, in the shards' dtype), the sizes and the number of layers. Refuses (`HFCheckpointError`)
    biases, parameters the layout has no key for, and missing parameters."""
    shards = [{_local_key(k): v for k, v in s.items()
               if not k.endswith("_extra_state") and not _local_key(k).startswith(_SHARED_PREFIXES)} for s in shards]
    for k, v in shards[0].items():
        if k.endswith(".bias"):
            raise HFCheckpointError(f"{where}: the drafter has the bias {k}; the DFlash layout has no biases "
                                    "(train with --disable-bias-linear, add_bias_linear=False)")
    shape, layers = _drafter_shape(shards, where)
    tp = len(shards)
    table = drafter_keys(layers)
    known = {k.megatron for k in table}
    extra = sorted(set(shards[0]) - known)
    if extra:
        raise HFCheckpointError(f"{where}: the DFlash layout has no key for the drafter's parameters {extra[:6]}")
    out = {}
    for k in table:
        if any(k.megatron not in s for s in shards):
            raise HFCheckpointError(f"{where}: the drafter has no parameter {k.megatron} (needed for {list(k.hf)})")
        if k.tp_dim is None:
            for s in shards[1:]:
                if not torch.equal(s[k.megatron], shards[0][k.megatron]):
                    diff = float((s[k.megatron].float() - shards[0][k.megatron].float()).abs().max())
                    raise HFCheckpointError(f"{where}: {k.megatron} is replicated over TP but differs between "
                                            f"the TP ranks (max |diff| {diff:.3g}): its gradients were not reduced "
                                            "over TP (Megatron's finalize_model_grads sums the q/k layernorm ones)")
            for name, piece in zip(k.hf, _unfuse(k.fuse, shards[0][k.megatron], (), 1)):
                out[name] = piece.contiguous()
            continue
        rows = [r // tp for r in shape.rows(k.fuse)] if k.fuse != "copy" else ()
        per_rank = [_unfuse(k.fuse, s[k.megatron], rows, shape.groups // tp) for s in shards]
        for j, name in enumerate(k.hf):
            out[name] = torch.cat([p[j] for p in per_rank], k.tp_dim).contiguous()
    return out, shape, layers


def _check_expressible(get: Callable[[str], Any], where: str) -> None:
    """Refuse drafter options the DFlash layout cannot express. `get(name)` returns a TransformerConfig
    field or Megatron flag value (None when unknown)."""
    bad = []
    if get("normalization") not in (None, "RMSNorm"):
        bad.append(f"normalization {get('normalization')!r} (DFlash uses RMSNorm)")
    for name in ("add_bias_linear", "add_qkv_bias"):
        if get(name):
            bad.append(f"{name} (DFlash has no biases)")
    if get("qk_layernorm") is False:
        bad.append("qk_layernorm off (DFlash always has q_norm / k_norm)")
    if get("gated_linear_unit") is False or get("swiglu") is False:
        bad.append("a non-gated MLP (DFlash uses SwiGLU: gate_proj / up_proj / down_proj)")
    act = get("activation_func")
    if act is not None and getattr(act, "__name__", str(act)) != "silu":
        bad.append(f"activation {getattr(act, '__name__', act)} (DFlash uses silu)")
    for name in ("layernorm_zero_centered_gamma", "apply_layernorm_1p", "rotary_interleaved",
                 "apply_residual_connection_post_layernorm", "multi_latent_attention"):
        if get(name):
            bad.append(f"{name} (not in Qwen3 / DFlash)")
    if get("num_moe_experts"):
        bad.append("MoE layers (DFlash layers are dense)")
    if get("rotary_percent") not in (None, 1.0):
        bad.append(f"rotary_percent {get('rotary_percent')} (DFlash rotates the whole head)")
    if get("softmax_scale") is not None:
        bad.append("a custom softmax_scale (DFlash uses head_dim ** -0.5)")
    if bad:
        raise HFCheckpointError(f"{where}: the DFlash Hugging Face layout cannot express this drafter: "
                                + "; ".join(bad))


def drafter_hf_config(shape: Qwen3Shape, num_layers: int, *, mask_token_id: int, target_layer_ids: Sequence[int],
                      num_target_layers: int, block_size: int, vocab_size: int, rope_theta: float,
                      rms_norm_eps: float = 1e-6, max_position_embeddings: int = 32768,
                      dtype: str = "float32", layer_types: Optional[Sequence[str]] = None,
                      sliding_window: Optional[int] = None, is_causal: Optional[bool] = None) -> dict:
    """The DFlash config.json dict (DESIGN.md section 6): architectures ["DFlashDraftModel"], model_type
    "qwen3", the Qwen3 fields, num_target_layers, block_size, dflash_config {mask_token_id,
    target_layer_ids}, and the layer types: `layer_types` (None: all full_attention), `sliding_window` and
    `use_sliding_window` (what z-lab's dflash and transformers' Qwen3Config read; Qwen3Config drops
    sliding_window unless use_sliding_window is true), with sliding layers also dflash_config {use_swa,
    swa_window_size} (what SGLang-style engines read), and `is_causal` (plus dflash_config.causal) when
    given (None: dflash's default, causal exactly for the sliding layers; `layer_types.layer_attention_kinds`).
    Errors: `HFCheckpointError` for tap ids outside [0, num_target_layers), a mask token outside the
    vocabulary, bad layer types (`layer_attention_kinds`' checks), or a fc width that is not
    len(target_layer_ids) * hidden (checked by the callers that know it)."""
    try:
        layer_attention_kinds(layer_types, num_layers=num_layers, sliding_window=sliding_window, is_causal=is_causal)
    except ValueError as exc:
        raise HFCheckpointError(f"drafter layer types: {exc}") from None
    sliding = layer_types is not None and "sliding_attention" in layer_types
    taps = [int(i) for i in target_layer_ids]
    if not taps or min(taps) < 0 or max(taps) >= num_target_layers:
        raise HFCheckpointError(f"target_layer_ids {taps} must lie in [0, num_target_layers = {num_target_layers})")
    if not 0 <= int(mask_token_id) < int(vocab_size):
        raise HFCheckpointError(f"mask_token_id {mask_token_id} is outside the vocabulary (vocab_size {vocab_size})")
    return {
        "architectures": [DRAFTER_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.groups,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.ffn,
        "hidden_act": "silu",
        "rms_norm_eps": float(rms_norm_eps),
        "rope_theta": float(rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(max_position_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": sliding,
        "sliding_window": int(sliding_window) if sliding else None,
        "layer_types": list(layer_types) if layer_types is not None else ["full_attention"] * int(num_layers),
        **({} if is_causal is None else {"is_causal": bool(is_causal)}),
        "dtype": dtype,
        "num_target_layers": int(num_target_layers),
        "block_size": int(block_size),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": taps,
                          **({"use_swa": True, "swa_window_size": int(sliding_window)} if sliding else {}),
                          **({} if is_causal is None else {"causal": bool(is_causal)})},
    }


#: suffix of a file being written by `save_dflash_hf` (renamed into place once complete)
PARTIAL = ".partial"


def save_dflash_hf(out_dir: str, config: dict, tensors: Dict[str, Tensor]) -> str:
    """Write `out_dir/model.safetensors` (metadata {"format": "pt"}) and then `out_dir/config.json`, each
    under a `.partial` name renamed into place when complete. A previous export's config.json is removed
    first, so a process killed at any point never leaves a config.json beside weights it does not describe
    (Hugging Face loaders then refuse the directory: no config.json). Returns out_dir. Raises
    `HFCheckpointError` when out_dir is an existing file."""
    from safetensors.torch import save_file  # the optional extra "hf"

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HFCheckpointError(f"{out_dir}: an existing file, not a directory (the export writes a directory)")
    os.makedirs(out_dir, exist_ok=True)
    config_path, weights_path = os.path.join(out_dir, "config.json"), os.path.join(out_dir, _SINGLE)
    if os.path.exists(config_path):
        os.remove(config_path)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, weights_path + PARTIAL,
              metadata={"format": "pt"})
    os.replace(weights_path + PARTIAL, weights_path)
    with open(config_path + PARTIAL, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(config_path + PARTIAL, config_path)
    return out_dir


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_fc(shape: Qwen3Shape, tensors: Dict[str, Tensor], taps: Sequence[int], where: str) -> None:
    if tensors["fc.weight"].shape[1] != len(taps) * shape.hidden:
        raise HFCheckpointError(f"{where}: fc.weight has {tensors['fc.weight'].shape[1]} inputs, but "
                                f"target_layer_ids {list(taps)} x hidden {shape.hidden} = {len(taps) * shape.hidden}")


def drafter_hf_state(model) -> Tuple[Dict[str, Tensor], Qwen3Shape, int]:
    """Gather an in-memory `DFlashDraftModel`'s TP shards (all-gather over `model.pg_collection.tp`) and
    convert them to the DFlash Hugging Face tensors. Collective: every rank of the TP group calls it.
    Returns (tensors by Hugging Face name, sizes, number of layers), the same on every rank.
    Errors: `HFCheckpointError` for what the layout cannot express (`_check_expressible`, biases)."""
    _check_expressible(lambda n: getattr(model.config, n, None), type(model).__name__)
    for layer in model.decoder.layers:
        attn = layer.self_attention
        if getattr(attn, "rotary_base", 1.0) is None:
            raise HFCheckpointError(f"{type(model).__name__}: the DFlash layout cannot express a drafter without "
                                    "RoPE (rotary_base None)")
        _check_expressible(lambda n: getattr(attn, n, None) if n == "rotary_percent" else None,
                           type(model).__name__)
    tp, _ = _tp_of(model)
    local = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    if tp == 1:
        shards = [local]
    else:
        group = model.pg_collection.tp
        shards = [dict() for _ in range(tp)]
        for k in sorted(local):
            if k.endswith("_extra_state") or _local_key(k).startswith(_SHARED_PREFIXES):
                continue
            parts = [torch.empty_like(local[k]) for _ in range(tp)]
            dist.all_gather(parts, local[k].contiguous(), group=group)
            for s, p in zip(shards, parts):
                s[k] = p
    return _drafter_shards_to_hf(shards, type(model).__name__)


def drafter_export_meta(model, *, target_layer_ids: Sequence[int], num_target_layers: int,
                        vocab_size: Optional[int] = None, max_position_embeddings: int = 32768) -> dict:
    """What config.json needs beyond the weights, for an in-memory `DFlashDraftModel`: store it in a
    checkpoint's common dict under `EXPORT_META_KEY` so that `export_checkpoint` (and `python -m
    megatron_splitkv.export`) can write the config later.

    Returns {mask_token_id, target_layer_ids, num_target_layers, block_size, vocab_size, rope_theta,
    rms_norm_eps, max_position_embeddings, layer_types, sliding_window, is_causal} (plain Python values).
    mask_token_id, block_size, rope theta (the layers' rotary_base), rms eps and the layer types (the model's
    `layer_attention`, `layer_types.hf_layer_fields`) come from the model; vocab_size defaults to the shared
    embedding's rows (`word_embeddings.num_embeddings`). HFCheckpointError for layer kinds the config
    cannot express (two windows; causal flags neither dflash's default nor one for all layers)."""
    try:
        layers = hf_layer_fields(getattr(model, "layer_attention", None), len(model.decoder.layers))
    except ValueError as exc:
        raise HFCheckpointError(f"{type(model).__name__}: {exc}") from None
    emb = model.word_embeddings
    vocab = vocab_size or getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    rope = getattr(model.decoder.layers[0].self_attention, "rotary_base", None)
    return dict(mask_token_id=int(model.mask_token_id), target_layer_ids=[int(i) for i in target_layer_ids],
                num_target_layers=int(num_target_layers), block_size=int(model.block_size), vocab_size=int(vocab),
                rope_theta=None if rope is None else float(rope),
                rms_norm_eps=float(model.config.layernorm_epsilon),
                max_position_embeddings=int(max_position_embeddings), **layers)


_META_NEEDED = ("mask_token_id", "target_layer_ids", "num_target_layers", "block_size", "vocab_size", "rope_theta")


def _write(out_dir: Optional[str], tensors: Dict[str, Tensor], shape: Qwen3Shape, layers: int, meta: dict,
           dtype: Optional[torch.dtype], where: str) -> dict:
    """config.json (from the sizes and `meta`) and model.safetensors (when out_dir is given) -> config."""
    missing = [k for k in _META_NEEDED if meta.get(k) is None]
    if missing:
        raise HFCheckpointError(f"{where}: field(s) {missing} of {EXPORT_META_KEY!r} missing; give them "
                                f"(--mask-token-id, --vocab-size, ... or meta=)")
    _check_fc(shape, tensors, meta["target_layer_ids"], where)
    dtype = dtype or tensors["fc.weight"].dtype
    kw = {k: meta[k] for k in _META_NEEDED}
    kw.update({k: meta[k] for k in ("rms_norm_eps", "max_position_embeddings", "layer_types", "sliding_window",
                                    "is_causal") if meta.get(k) is not None})
    config = drafter_hf_config(shape, layers, dtype=_dtype_name(dtype), **kw)
    if out_dir is not None:
        save_dflash_hf(out_dir, config, {k: v.to(dtype) for k, v in tensors.items()})
    return config


def export_drafter(model, out_dir: Optional[str], *, target_layer_ids: Sequence[int], num_target_layers: int,
                   vocab_size: Optional[int] = None, max_position_embeddings: int = 32768,
                   dtype: Optional[torch.dtype] = None) -> dict:
    """Export an in-memory `DFlashDraftModel` (any TP size) in the DFlash Hugging Face layout.

    Collective over the model's TP group (`drafter_hf_state`); the ranks that pass `out_dir` write it
    (pass None on all but one rank, e.g. `out_dir if dist.get_rank() == 0 else None`).
    Args: target_layer_ids / num_target_layers: the taps and the target's depth; vocab_size,
        max_position_embeddings: see `drafter_export_meta`; dtype: tensor dtype written (default the
        parameters').
    Returns the config.json dict. Errors: `HFCheckpointError` (what the layout cannot express, tap ids
        outside the target, a fc width that is not len(target_layer_ids) * hidden).
    """
    meta = drafter_export_meta(model, target_layer_ids=target_layer_ids, num_target_layers=num_target_layers,
                               vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    tensors, shape, layers = drafter_hf_state(model)
    return _write(out_dir, tensors, shape, layers, meta, dtype, type(model).__name__)


# --------------------------------------------------------------------------------------- from checkpoints
def _is_torch_dist(d: str) -> bool:
    return os.path.exists(os.path.join(d, ".metadata")) or os.path.exists(os.path.join(d, "metadata.json"))


def _iteration_dir(load: str, step: Optional[int]) -> str:
    """The iteration directory to export, verified against its manifest (`megatron_splitkv.checkpoint`):
    ``iter_{step}``, the one the tracker names, or `load` itself when it has no tracker. Raises
    `HFCheckpointError` (one line naming the file: garbage tracker, missing manifest, damaged file)."""
    if not os.path.isdir(load):
        raise HFCheckpointError(f"--load {load}: no such directory")
    try:
        it = read_tracker(load) if step is None else int(step)
        d = load if it is None else os.path.join(load, "release") if it == "release" else iteration_dir(load, it)
        if _is_torch_dist(d):
            raise HFCheckpointError(f"{d}: a Megatron torch_dist checkpoint, which this export does not read; "
                                    "save with --ckpt-format torch, or export the in-memory model (export_drafter)")
        if it is None:
            verify_manifest(d)
            return d
        return resolve_checkpoint(load, it)
    except CheckpointError as exc:
        raise HFCheckpointError(f"--load {load}: {exc}") from None


def _torch_load(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


def _megatron_torch_shards(d: str) -> Tuple[List[Dict[str, Tensor]], Any]:
    """Megatron's `--ckpt-format torch`: `mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`, one per TP rank."""
    dirs = sorted(x for x in os.listdir(d) if x.startswith("mp_rank_"))
    if any(len(x.split("_")) > 3 and x.split("_")[3] != "000" for x in dirs):
        raise HFCheckpointError(f"{d}: a pipeline-parallel checkpoint ({dirs[:4]}); the drafter runs on one stage")
    shards, args = [], None
    for i, x in enumerate(dirs):
        if not x.startswith(f"mp_rank_{i:02d}"):
            raise HFCheckpointError(f"{d}: TP shard directory mp_rank_{i:02d} is missing (found {dirs})")
        ck = _torch_load(os.path.join(d, x, "model_optim_rng.pt"))
        shards.append(ck["model"])
        args = ck.get("args", args)
    return shards, args


def _meta_from_megatron_args(args) -> dict:
    layers, target_layers = getattr(args, "num_layers", None), getattr(args, "target_num_layers", None)
    meta = dict(mask_token_id=getattr(args, "mask_token_id", None),
                block_size=getattr(args, "dflash_block_size", None) or 16,
                vocab_size=getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None),
                rope_theta=getattr(args, "rotary_base", None), rms_norm_eps=getattr(args, "norm_epsilon", None),
                max_position_embeddings=getattr(args, "max_position_embeddings", None),
                num_target_layers=target_layers)
    types, causal = getattr(args, "dflash_layer_types", None), getattr(args, "dflash_is_causal", None)
    if isinstance(types, str):  # the flag's text, as written on the command line
        types = [t.strip() for t in types.split(",")]
    if causal is None or isinstance(causal, bool):
        is_causal = causal
    elif isinstance(causal, str) and causal in ("true", "false"):
        is_causal = causal == "true"
    else:
        raise HFCheckpointError(f"checkpoint args: dflash_is_causal (--dflash-is-causal) must be 'true', 'false' or "
                                f"unset, got {causal!r}")
    meta.update(layer_types=None if types is None else list(types),
                sliding_window=getattr(args, "dflash_sliding_window", None), is_causal=is_causal)
    if layers and target_layers:
        meta["target_layer_ids"] = target_layer_ids(target_layers, layers)
    return {k: v for k, v in meta.items() if v is not None}


def export_checkpoint(load: str, out_dir: str, *, step: Optional[int] = None, meta: Optional[dict] = None,
                      dtype: Optional[torch.dtype] = None) -> dict:
    """Export a drafter checkpoint on disk in the DFlash Hugging Face layout (no process group needed).

    Formats (the iteration named by `load/latest_checkpointed_iteration.txt`, `iter_{step:07d}` with
    `step`, or `load` itself when it is an iteration directory):
      * the demo's (`python examples/train_demo.py --save`): `common.pt` with "model" (the
        drafter's trained parameters, TP 1) and `EXPORT_META_KEY` ("dflash_export": the keyword arguments
        of `drafter_hf_config` other than the sizes: mask_token_id, target_layer_ids, num_target_layers,
        block_size, vocab_size, rope_theta, rms_norm_eps, max_position_embeddings), else its "args";
      * Megatron's `--ckpt-format torch` (`examples/pretrain_dflash.py --save`): one
        `mp_rank_{tp:02d}/model_optim_rng.pt` per TP rank, gathered here; the metadata from its "args"
        (--mask-token-id, --target-num-layers, --num-layers, --dflash-block-size, --rotary-base, ...).
    Megatron's `torch_dist` format is refused (re-save with `--ckpt-format torch`, or export the in-memory
    model with `export_drafter`). The iteration directory is first verified against its manifest
    (`megatron_splitkv.checkpoint.verify_manifest`: written by the demo's and by Megatron's saves with this
    package's manifest hook); a missing manifest, a damaged file or a garbage tracker is refused.
    Args: meta: values that replace / complete the checkpoint's metadata (same keys). dtype: written dtype.
    Returns the config.json dict. Errors: `HFCheckpointError` naming the file and the missing field.
    """
    d = _iteration_dir(load, step)
    common_path = os.path.join(d, "common.pt")
    if os.path.exists(common_path):
        common = _torch_load(common_path)
        if not isinstance(common, dict) or "model" not in common:
            raise HFCheckpointError(f"{common_path}: field model is missing (not a megatron_splitkv demo checkpoint)")
        shards, where = [common["model"]], common_path
        found = dict(common.get(EXPORT_META_KEY) or {})
        if not found and "args" in common:
            a = common["args"]
            found = dict(block_size=a.get("block_size"), num_target_layers=a.get("target_layers"),
                         target_layer_ids=target_layer_ids(a["target_layers"], a["draft_layers"])
                         if a.get("target_layers") and a.get("draft_layers") else None)
            found = {k: v for k, v in found.items() if v is not None}
    elif any(x.startswith("mp_rank_") for x in os.listdir(d) if os.path.isdir(os.path.join(d, x))):
        shards, args = _megatron_torch_shards(d)
        where = os.path.join(d, "mp_rank_00", "model_optim_rng.pt")
        found = _meta_from_megatron_args(args) if args is not None else {}
        if args is not None:
            _check_expressible(lambda n: getattr(args, n, None), where)
    else:
        raise HFCheckpointError(f"{d}: neither common.pt (demo) nor mp_rank_*/model_optim_rng.pt (Megatron "
                                "--ckpt-format torch): not a drafter checkpoint this export reads")
    found.update(meta or {})
    tensors, shape, layers = _drafter_shards_to_hf(shards, where)
    return _write(out_dir, tensors, shape, layers, found, dtype, where)
