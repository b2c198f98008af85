"""A compact vocabulary: the tokenizer ids a small model uses, renumbered 0..n-1, plus one MASK row.

A tiny model (the demo's target) keeps its embedding and LM head small by holding rows only for the
tokenizer ids it meets: model id j stands for tokenizer id ``token_ids[j]`` (sorted, unique), and model id
n = len(token_ids) is DFlash's MASK token (a reserved row no text maps to). The map is saved next to the
model's Hugging Face files as ``token_map.json``::

    {"format": 1, "tokenizer": "qwen2.5-72b-instruct", "token_ids": [...]}

A model directory without that file uses the tokenizer's ids unchanged (a real Qwen3 checkpoint).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from .sharegpt import TOKENIZER_NAME

__all__ = ["TOKEN_MAP_FILE", "CompactVocab"]

TOKEN_MAP_FILE = "token_map.json"
_FORMAT = 1


@dataclass(frozen=True)
class CompactVocab:
    """Tokenizer ids <-> compact model ids (see the module docstring).

    token_ids: [n] int64, sorted and unique; tokenizer: the tokenizer the ids belong to.
    """

    token_ids: np.ndarray
    tokenizer: str = TOKENIZER_NAME

    @classmethod
    def from_tokens(cls, *arrays, tokenizer: str = TOKENIZER_NAME) -> "CompactVocab":
        """The vocabulary of every id in `arrays` (integer arrays of tokenizer ids)."""
        parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
        ids = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if ids.size and ids[0] < 0:
            raise ValueError(f"token ids must be >= 0, got {int(ids[0])}")
        return cls(ids, tokenizer)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def mask_token_id(self) -> int:
        """The MASK token's model id (the row after the last mapped id)."""
        return len(self)

    @property
    def num_rows(self) -> int:
        """Rows the model's embedding needs at least: the mapped ids and MASK."""
        return len(self) + 1

    def known(self, tokens) -> np.ndarray:
        """[...] bool: which tokenizer ids in `tokens` have a model id."""
        t = np.asarray(tokens, dtype=np.int64)
        pos = np.clip(np.searchsorted(self.token_ids, t), 0, max(len(self) - 1, 0))
        return (self.token_ids[pos] == t) if len(self) else np.zeros(t.shape, bool)

    def encode(self, tokens, what: str = "tokens") -> np.ndarray:
        """Tokenizer ids -> model ids (int64, same shape). Raises ValueError naming `what`, the number of
        unknown ids and the first of them when an id has no row."""
        t = np.asarray(tokens, dtype=np.int64)
        ok = self.known(t)
        if not ok.all():
            bad = t[~ok]
            raise ValueError(f"{what}: {bad.size} token id(s) outside the compact vocabulary of {len(self)} ids "
                             f"(first: {int(bad.reshape(-1)[0])})")
        return np.searchsorted(self.token_ids, t).astype(np.int64)

    def decode(self, model_ids) -> np.ndarray:
        """Model ids -> tokenizer ids; the MASK id (and anything outside the map) gives -1."""
        m = np.asarray(model_ids, dtype=np.int64)
        inside = (m >= 0) & (m < len(self))
        return np.where(inside, self.token_ids[np.clip(m, 0, max(len(self) - 1, 0))], -1)

    def save(self, directory: str) -> str:
        """Write ``directory/token_map.json``; returns its path."""
        path = os.path.join(directory, TOKEN_MAP_FILE)
        with open(path, "w") as f:
            json.dump({"format": _FORMAT, "tokenizer": self.tokenizer,
                       "token_ids": [int(i) for i in self.token_ids]}, f)
        return path

    @classmethod
    def load(cls, directory: str) -> "CompactVocab | None":
        """The map saved in `directory`, or None when it has no ``token_map.json``. Raises ValueError
        naming the file and the field for a malformed map."""
        path = os.path.join(directory, TOKEN_MAP_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ValueError(f"{path}: field 'format' must be {_FORMAT}")
        ids = d.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"{path}: field 'token_ids' must be a list of integers >= 0")
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size > 1 and not (np.diff(arr) > 0).all():
            raise ValueError(f"{path}: field 'token_ids' must be sorted and unique")
        return cls(arr, str(d.get("tokenizer", TOKENIZER_NAME)))
