"""Per-layer attention types of a DFlash drafter (`full_attention` / `sliding_attention`), as z-lab's dflash 0.1.0
builds them (`dflash/model.py`, `Qwen3DFlashAttention.__init__`) from a Hugging Face config:

    layer_type   = config.layer_types[i]          (no layer_types: every layer full_attention)
    is_causal    = config.is_causal if set, else layer_type == "sliding_attention"
    window       = config.sliding_window if layer_type == "sliding_attention" else None

A layer's attention kind is the pair (window, causal) that the ops take (`window=`, `causal=`): row j of the
block at anchor a sees the context keys of its sequence with ``a + j - window < position < a`` (no window: every
position < a), and own-block key i iff ``(not causal or i <= j)`` and, with a window, ``j - i < window`` and
``(causal or i - j < window)`` (dflash's `_attention_mask`).

Pure Python (no torch): argument parsing uses it.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ._ints import _shown, as_int

__all__ = ["LAYER_TYPES", "FULL", "SLIDING", "MAX_WINDOW", "layer_attention_kinds", "layer_windows",
           "hf_layer_fields"]

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
#: the largest sliding window W: positions and windows are int64 in the masks (a larger W would wrap)
MAX_WINDOW = 2**63 - 1

#: (window, causal) of one layer
Kind = Tuple[Optional[int], bool]


def layer_attention_kinds(layer_types: Optional[Sequence[str]], *, num_layers: int,
                          sliding_window: Optional[int] = None, is_causal: Optional[bool] = None,
                          names: Optional[dict] = None) -> Tuple[Kind, ...]:
    """The (window, causal) of each of `num_layers` drafter layers, by dflash's rule (module docstring).

    Args:
        layer_types: one of LAYER_TYPES per layer, or None (every layer full_attention).
        num_layers: the drafter's layer count. sliding_window: W (int >= 1), needed iff a layer is sliding.
        is_causal: dflash's config.is_causal (None: causal exactly for the sliding layers).
        names: how errors call the arguments, e.g. {"layer_types": "--dflash-layer-types"} (default: the
            config field names layer_types, sliding_window, is_causal, num_layers).
    Raises ValueError naming the argument: an unknown layer type, a length other than num_layers, a window
    < 1 or not an int, a sliding layer without a window, a window without a sliding layer (it would be
    dropped), is_causal not a bool.
    """
    n = {"layer_types": "layer_types", "sliding_window": "sliding_window", "is_causal": "is_causal",
         "num_layers": "num_layers", **(names or {})}
    num_layers = as_int(num_layers, n["num_layers"], minimum=1)
    types = (FULL,) * num_layers if layer_types is None else tuple(layer_types)
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"{n['layer_types']} entries must be one of {', '.join(LAYER_TYPES)}, got {_shown(bad[0])}")
    if len(types) != num_layers:
        raise ValueError(f"{n['layer_types']} must name one type per drafter layer: {n['num_layers']} is "
                         f"{num_layers}, got {len(types)} ({','.join(types)})")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ValueError(f"{n['is_causal']} must be true, false or unset, got {_shown(is_causal)}")
    if SLIDING in types:
        if sliding_window is None:
            raise ValueError(f"{n['layer_types']} has sliding_attention layers: {n['sliding_window']} (the window W, "
                             "an int >= 1) is required")
        sliding_window = as_int(sliding_window, n["sliding_window"], minimum=1, maximum=MAX_WINDOW,
                                what="a positive int (window W) < 2**63")
    elif sliding_window is not None:
        raise ValueError(f"{n['sliding_window']} ({_shown(sliding_window)}) applies to sliding_attention layers, "
                         f"but {n['layer_types']} has none ({','.join(types)})")
    return tuple((sliding_window, True if is_causal is None else is_causal) if t == SLIDING
                 else (None, bool(is_causal)) for t in types)


def layer_windows(kinds: Optional[Sequence[Kind]]) -> Optional[Tuple[Optional[int], ...]]:
    """The per-layer windows of `kinds` for the planner's `CostModel.layer_windows` (None when no layer has a
    window: every layer sees all context, the default cost)."""
    if not kinds or all(w is None for w, _ in kinds):
        return None
    return tuple(w for w, _ in kinds)


def hf_layer_fields(kinds: Optional[Sequence[Kind]], num_layers: int) -> dict:
    """The Hugging Face config fields that make dflash (and the serving engines) build layers of these kinds:
    {"layer_types": [...], "sliding_window": W or None, "is_causal": bool or None (None: dflash's per-type
    default holds, so the field is left out)}; the inverse of `layer_attention_kinds`. `kinds` None: every
    layer full, non-causal. ValueError for kinds the config cannot express: two different windows (one
    config.sliding_window), or causal flags that are neither dflash's default nor one value for all layers."""
    kinds = tuple((None, False) for _ in range(num_layers)) if kinds is None else tuple(kinds)
    if len(kinds) != num_layers:
        raise ValueError(f"layer kinds: {len(kinds)} given for {num_layers} layers")
    windows = sorted({w for w, _ in kinds if w is not None})
    if len(windows) > 1:
        raise ValueError(f"layer kinds with windows {windows}: the DFlash config has one sliding_window")
    types = [SLIDING if w is not None else FULL for w, _ in kinds]
    causal = {bool(c) for _, c in kinds}
    if all(bool(c) == (t == SLIDING) for t, (_, c) in zip(types, kinds)):
        is_causal = None  # dflash's default: causal exactly for the sliding layers
    elif len(causal) == 1:
        is_causal = causal.pop()
    else:
        raise ValueError(f"layer kinds {list(kinds)}: causal per layer is neither dflash's default (sliding layers "
                         "causal, full ones not) nor one value for every layer (config.is_causal)")
    return {"layer_types": types, "sliding_window": windows[0] if windows else None, "is_causal": is_causal}
