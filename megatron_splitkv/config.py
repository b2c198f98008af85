"""The options of the CP attention ops and their kernels, as data: `SplitKVConfig` and the kernels' option
objects `FlexOptions` and `StaircaseOptions`.

One frozen dataclass, built once (from keyword arguments in plain PyTorch, from the flags in a Megatron job:
`megatron_splitkv.megatron.arguments`), carried by the per-step metadata and the layer spec's params. Every
field has a default equal to the library's behaviour without options; `__post_init__` validates each field
and raises ValueError naming it (`SplitKVConfig.num_chunks`) and its limit. `digest()` is a stable hash of
all fields (the same on every rank and every run for equal configs), `field_digests()` one per field, for
the CP group's agreement check.

Pure Python (no torch import): argument parsing and the data loader can build a config.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from ._ints import as_int

__all__ = ["SplitKVConfig", "FlexOptions", "StaircaseOptions", "CHUNK_AXES", "DEFAULT_NUM_CHUNKS",
           "FUSED_BWD_GATHER_MIN_P", "STAIRCASE_AUTO_MIN_KEYS", "resolve_config"]

#: the chunk axes of Split-KV's pipeline (ops/splitkv.py, "Head chunks")
CHUNK_AXES = ("rows", "heads")
#: chunk count when `num_chunks` is None: 1, no pipelining (docs/tuning.md: 2 wins only across nodes)
DEFAULT_NUM_CHUNKS = 1
#: smallest CP group whose backward gathers dO and (delta, lse) in one all-gather: groups above an 8-GPU node
FUSED_BWD_GATHER_MIN_P = 9
#: context keys per kernel call from which backend="auto" picks the staircase kernel (docs/kernels.md)
STAIRCASE_AUTO_MIN_KEYS = 32768

#: the staircase kernel's remainder-kernel names ("staircase" excluded: it would be its own remainder kernel)
STAIRCASE_INNER_CHOICES = ("auto", "math", "flex", "te", "fa4")
_STAIRCASE_CHOICES = dict(bwd_mode=("auto", "query", "key"), gqa=("fold", "native"),
                          kv_layout=("auto", "view", "copy"), inner=STAIRCASE_INNER_CHOICES)


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")


def _check_int(owner: str, name: str, value, minimum: int, allow_none: bool = False):
    """`value` as an int >= minimum (`_ints.as_int`: no bool, no float), or None when allowed."""
    if value is None and allow_none:
        return None
    limit = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    return as_int(value, f"{owner}.{name}", minimum=minimum, what=("None or " if allow_none else "") + limit)


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)  # normalising a field of a frozen dataclass in __post_init__


def _canonical(value) -> str:
    """A text that names `value` exactly and identically in every process (no id(), no hash randomisation)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__ + "(" + ",".join(
            f"{f.name}={_canonical(getattr(value, f.name))}" for f in dataclasses.fields(value)) + ")"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_canonical(v) for v in value) + ")"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"  # e.g. a kernel object as staircase inner


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Digest:
    """`digest()` and `field_digests()` for a dataclass."""

    def field_digests(self) -> dict:
        """{field name: 16 hex digits} of every field, stable across processes and runs."""
        return {f.name: _sha(f"{f.name}={_canonical(getattr(self, f.name))}") for f in dataclasses.fields(self)}

    def digest(self) -> str:
        """16 hex digits: a stable hash of every field (equal configs, equal digests, in any process)."""
        return _sha(_canonical(self))


@dataclass(frozen=True)
class FlexOptions(_Digest):
    """Options of the FlexAttention kernel (`kernels.flex.FlexAttentionKernel`).

    Fields:
        bucket_steps: bucket steps per octave of the padded KEY length (>= 1): 2 -> {2, 3} x 2**e x 128, at
            most 50% padded keys, two compiled shapes per octave.
        q_bucket_steps: the same for the padded QUERY length (>= 1).
        reuse_larger_kv_bucket: reuse an already-compiled key bucket one step above the own one.
        kernel_options: FlexAttention's `kernel_options` (block sizes, ...), as (name, value) pairs or a dict;
            None: FlexAttention's own choice. Stored as a sorted tuple of pairs.
        cache_block_mask: cache the BlockMask on the step's IntervalMask (built once per step, not per layer).
    """

    bucket_steps: int = 2
    q_bucket_steps: int = 2
    reuse_larger_kv_bucket: bool = True
    kernel_options: tuple | None = None
    cache_block_mask: bool = True

    def __post_init__(self):
        for name in ("bucket_steps", "q_bucket_steps"):
            _set(self, name, _check_int("FlexOptions", name, getattr(self, name), 1))
        _check_bool("FlexOptions", "reuse_larger_kv_bucket", self.reuse_larger_kv_bucket)
        _check_bool("FlexOptions", "cache_block_mask", self.cache_block_mask)
        opts = self.kernel_options
        if opts is not None:
            try:
                items = sorted(dict(opts).items())
            except (TypeError, ValueError):
                raise ValueError("FlexOptions.kernel_options must be None, a dict or (name, value) pairs of "
                                 f"FlexAttention kernel options, got {opts!r}") from None
            if any(not isinstance(k, str) for k, _ in items):
                raise ValueError(f"FlexOptions.kernel_options names must be strings, got {opts!r}")
            _set(self, "kernel_options", tuple(items))

    def kernel_options_dict(self) -> dict | None:
        """`kernel_options` as the dict FlexAttention takes (None when unset)."""
        return None if self.kernel_options is None else dict(self.kernel_options)


#: the staircase options that may be 0
_STAIRCASE_ZERO_OK = ("min_pairs", "sub_group_blocks", "max_tile_keys", "piece_min_pairs")


@dataclass(frozen=True)
class StaircaseOptions(_Digest):
    """Options of the staircase kernel (`kernels.staircase.StaircaseAttentionKernel`; docs/kernels.md,
    "Staircase"). Integer fields are ints (no bool or float): >= 0 for min_pairs, sub_group_blocks,
    max_tile_keys, piece_min_pairs, else >= 1.

    Fields:
        group_blocks, sub_group_blocks, min_group_blocks: anchor blocks per dense group (largest, inner,
            smallest).
        key_grain: key-length rounding of the dense calls; min_keys: shortest dense key range.
        min_pairs: smallest (query, key) pair count of a dense rectangle; piece_min_pairs: the same for the
            bucket pieces (None: = min_pairs).
        kmajor_min_keys: key count from which the backward runs key-major.
        streams: CUDA streams of the dense calls (1: the caller's only).
        bwd_mode: "auto" | "query" | "key"; gqa: "fold" | "native"; kv_layout: "auto" | "view" | "copy".
        inner: the remainder kernel, a backend name ("auto", "math", "flex", "te", "fa4") or a local kernel
            object with forward/backward (not a staircase kernel).
        key_buckets, key_pieces, max_tile_keys: bounded dense shapes (key lengths per octave, bucket pieces
            per rectangle, longest dense key range).
    """

    group_blocks: int = 128
    sub_group_blocks: int = 32
    min_group_blocks: int = 8
    key_grain: int = 256
    min_keys: int = 512
    min_pairs: int = 1 << 20
    kmajor_min_keys: int = 2048
    streams: int = 2
    bwd_mode: str = "query"
    gqa: str = "fold"
    kv_layout: str = "auto"
    inner: object = "auto"
    key_buckets: int = 4
    key_pieces: int = 1
    max_tile_keys: int = 65536
    piece_min_pairs: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "inner" and not isinstance(value, str):
                if not (callable(getattr(value, "forward", None)) and callable(getattr(value, "backward", None))) \
                        or getattr(value, "name", None) == "staircase":
                    raise ValueError("StaircaseOptions.inner must be a backend name ("
                                     f"{', '.join(STAIRCASE_INNER_CHOICES)}) or a local kernel object with "
                                     f"forward/backward (not a staircase kernel), got {value!r}")
            elif f.name in _STAIRCASE_CHOICES:
                if not isinstance(value, str) or value not in _STAIRCASE_CHOICES[f.name]:
                    raise ValueError(f"StaircaseOptions.{f.name} must be one of "
                                     f"{', '.join(_STAIRCASE_CHOICES[f.name])}, got {value!r}")
            else:
                minimum = 0 if f.name in _STAIRCASE_ZERO_OK else 1
                _set(self, f.name, _check_int("StaircaseOptions", f.name, value, minimum,
                                              allow_none=f.name == "piece_min_pairs"))


@dataclass(frozen=True)
class SplitKVConfig(_Digest):
    """Every option of the CP attention ops (`splitkv_attention`, `prepare_splitkv_metadata(_from_plan)`, the
    baselines `allgather_kv_attention` / `ring_kv_attention`) and of their kernels. The defaults are the
    library's behaviour with no option given. Every rank of a CP group must hold an equal config (equal
    `digest()`); the ops check it.

    Fields:
        num_chunks: Split-KV's pipeline chunk count; None: `DEFAULT_NUM_CHUNKS` = 1. A positive int, clamped
            to the largest per-rank block count (rows) or to Hkv (heads).
        chunk_axis: "rows" (chunks of query blocks) or "heads" (chunks of kv heads; every chunk sees all keys).
        cp_ranks_per_node: L, CP ranks per node of the two-level all-to-all: None (1) or a positive int
            describing the machine, clamped to the CP size P, then a divisor of P (L = 1 or P: one all-to-all
            over the CP group; 1 < L < P: two stages). The op's `cp_ranks_per_node=` argument is not clamped.
        overlap_q_gather: the Megatron layer starts the query gather before the kv projection (early
            query gather); True (default) or False.
        debug_checks: re-check the interval masks the ops build themselves against the union contract of
            `kernels/base.py` (a test aid; input validation is not affected). Default False.
        auto_fa4: backend="auto" may pick "fa4" where it runs (default True).
        staircase_auto_min_keys: context keys per kernel call from which backend="auto" picks "staircase"
            (an int >= 0; 0: never). Default 32768.
        flex: the FlexAttention kernel's options (`FlexOptions`).
        staircase: the staircase kernel's options (`StaircaseOptions`).

    Raises: ValueError naming the field (`SplitKVConfig.<field>`) and its limit.
    """

    num_chunks: int | None = None
    chunk_axis: str = "rows"
    cp_ranks_per_node: int | None = None
    overlap_q_gather: bool = True
    debug_checks: bool = False
    auto_fa4: bool = True
    staircase_auto_min_keys: int = STAIRCASE_AUTO_MIN_KEYS
    flex: FlexOptions = field(default_factory=FlexOptions)
    staircase: StaircaseOptions = field(default_factory=StaircaseOptions)

    def __post_init__(self):
        own = "SplitKVConfig"
        _set(self, "num_chunks", _check_int(own, "num_chunks", self.num_chunks, 1, allow_none=True))
        if not isinstance(self.chunk_axis, str) or self.chunk_axis not in CHUNK_AXES:
            raise ValueError(f"{own}.chunk_axis must be one of {', '.join(CHUNK_AXES)}, got {self.chunk_axis!r}")
        _set(self, "cp_ranks_per_node", _check_int(own, "cp_ranks_per_node", self.cp_ranks_per_node, 1,
                                                   allow_none=True))
        _set(self, "staircase_auto_min_keys", _check_int(own, "staircase_auto_min_keys",
                                                         self.staircase_auto_min_keys, 0))
        for name in ("overlap_q_gather", "debug_checks", "auto_fa4"):
            _check_bool(own, name, getattr(self, name))
        for name, cls in (("flex", FlexOptions), ("staircase", StaircaseOptions)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{own}.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "SplitKVConfig":
        """A copy with `changes` applied (validated); fields given as None keep their value here, so that
        `config.replace(num_chunks=num_chunks)` applies a keyword argument only when it was given."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def resolved_num_chunks(self) -> int:
        """The requested chunk count: num_chunks, else `DEFAULT_NUM_CHUNKS`."""
        return self.num_chunks if self.num_chunks is not None else DEFAULT_NUM_CHUNKS


def resolve_config(config: SplitKVConfig | None, **overrides) -> SplitKVConfig:
    """`config` (None: `SplitKVConfig()`) with the keyword arguments that were given (not None) applied: the
    ops' `num_chunks=`, `chunk_axis=`, `cp_ranks_per_node=`, ... build or override the config. Raises
    ValueError for a config that is no SplitKVConfig or an invalid override (naming the field)."""
    if config is None:
        config = SplitKVConfig()
    elif not isinstance(config, SplitKVConfig):
        raise ValueError(f"config must be None or a SplitKVConfig, got {type(config).__name__}")
    return config.replace(**overrides)
