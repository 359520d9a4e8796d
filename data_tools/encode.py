"""Text to token ids: raw bytes, or a ``tokenizers`` tokenizer (trained byte-level BPE or a tokenizer.json).

The ``tokenizers`` pipeline spends most of its time outside BPE (offsets,
alignments, per-token strings): about 1.2-2 MB/s per core. For GPT-2's layout
(no normalizer, the ``ByteLevel`` pre-tokenizer with its split regex and no
prefix space, a BPE model: GPT-2's own tokenizer.json and the BPE trained here)
:class:`TokenizerEncoder` takes a short cut that gives the same ids. On ASCII
text the split regex reduces to ASCII classes that Python's ``re`` runs
identically; each distinct piece is encoded once by the tokenizer's own BPE
model and cached; a text's ids are gathered from the cache with numpy.
Non-ASCII parts of a text, texts holding an added token's text, and other
tokenizers go through the library's ``encode_batch`` (parallel on its thread pool).
"""

from __future__ import annotations

import hashlib
import json
import re
from itertools import chain

import numpy as np

from trainrun.errors import UsageError

EOS_TOKEN = "<|endoftext|>"
BYTES_TOKENIZER_ID = "bytes"

# GPT-2's split  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+  restricted
# to ASCII text: \p{L} = [A-Za-z], \p{N} = [0-9], Unicode \s = [\t\n\v\f\r ] (not \x1c-\x1f, which
# Python's \s would take).
_WS = r"\t\n\x0b\x0c\r "
ASCII_GPT2_SPLIT = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+")

# Cut points (see TokenizerEncoder._units): the character before the printable one that ends a match.
_LINE_CUT = re.compile(rf"\n[{_WS}]*[!-~]")
_WORD_CUT = re.compile(rf"[{_WS}][!-~]")
_CACHE_LIMIT = 2_000_000   # distinct pieces kept before the cache starts over


class BytesEncoder:
    """UTF-8 bytes as tokens 0..255; EOS is 256."""

    vocab_size, eos_id, tokenizer, tokenizer_id, tokenizer_json = 257, 256, None, BYTES_TOKENIZER_ID, None
    start, end = np.zeros(0, np.int64), np.array([256], np.int64)   # the ids before and after each document

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]


class TokenizerEncoder:
    """A ``tokenizers.Tokenizer`` with a fast path for GPT-2-style byte-level BPE (see the module doc)."""

    def __init__(self, tokenizer, eos: str = EOS_TOKEN):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.token_to_id(eos)
        if self.eos_id is None:
            raise UsageError(f"the tokenizer has no end-of-document token '{eos}'; name one with --eos")
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer_json = tokenizer.to_str(pretty=True)    # what tokenizer.json holds
        self.tokenizer_id = "sha256:" + hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()
        self.start, self.end = _framing(tokenizer, self.eos_id)
        self.fast = _gpt2_like(tokenizer)
        self._byte_chars = _byte_level_chars() if self.fast else None
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._reset_cache()

    def _reset_cache(self) -> None:
        self._index: dict[str, int] = {}
        self._flat = np.zeros(0, np.int64)      # ids of all cached pieces, concatenated
        self._start = np.zeros(0, np.int64)
        self._len = np.zeros(0, np.int64)

    def _units(self, text: str) -> list[tuple[str, bool]]:
        """``text`` as consecutive (part, fast) units whose encodings concatenate to the text's.

        GPT-2's split always has a piece boundary before the last whitespace
        character of a run that is followed by a non-space, and the pieces on
        either side stay the same when the text is cut there. So a non-ASCII
        text is cut there (at lines, then, in lines with non-ASCII characters,
        at words) and only the non-ASCII parts go through the library.
        """
        if not self.fast or (self._added and self._added.search(text)):
            return [(text, False)]
        if text.isascii():
            return [(text, True)]
        units: list[tuple[list, bool]] = []
        for line in _cut(text, _LINE_CUT):
            parts = [line] if line.isascii() else _cut(line, _WORD_CUT)
            for part in parts:
                fast = part.isascii()
                if units and units[-1][1] == fast:
                    units[-1][0].append(part)
                else:
                    units.append(([part], fast))
        return [("".join(parts), fast) for parts, fast in units]

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added: see ``start`` and ``end``)."""
        units = [(d, part, fast) for d, text in enumerate(texts) for part, fast in self._units(text) if part]
        ids: list[np.ndarray] = [None] * len(units)
        slow = [u for u, (_, _, fast) in enumerate(units) if not fast]
        if slow:
            encs = self.tokenizer.encode_batch_fast([units[u][1] for u in slow], add_special_tokens=False)
            for u, enc in zip(slow, encs):
                ids[u] = np.asarray(enc.ids, np.int64)
        fast = [u for u, (_, _, f) in enumerate(units) if f]
        if fast:
            pieces = [ASCII_GPT2_SPLIT.findall(units[u][1]) for u in fast]
            flat = list(chain.from_iterable(pieces))
            self._learn(set(flat))
            piece_ids = np.fromiter(map(self._index.__getitem__, flat), np.int64, len(flat))
            tokens = self._gather(piece_ids)
            per_unit = np.add.reduceat(self._len[piece_ids], np.cumsum([0] + [len(p) for p in pieces[:-1]]))
            for u, part in zip(fast, np.split(tokens, np.cumsum(per_unit)[:-1])):
                ids[u] = part
        out = [[] for _ in texts]
        for (d, _, _), arr in zip(units, ids):
            out[d].append(arr)
        return [np.concatenate(a) if a else np.zeros(0, np.int64) for a in out]

    def _learn(self, pieces: set) -> None:
        """Encode the pieces not yet cached and append them to the cache."""
        new = sorted(pieces.difference(self._index))
        if not new:
            return
        if len(self._index) + len(new) > _CACHE_LIMIT:
            self._reset_cache()
            new = sorted(pieces)
        tokenize, table = self.tokenizer.model.tokenize, self._byte_chars
        ids = [[t.id for t in tokenize(p.translate(table))] for p in new]
        lens = np.fromiter(map(len, ids), np.int64, len(ids))
        base = len(self._index)
        self._index.update(zip(new, range(base, base + len(new))))
        self._start = np.concatenate([self._start, len(self._flat) + np.cumsum(lens) - lens])
        self._len = np.concatenate([self._len, lens])
        self._flat = np.concatenate([self._flat, np.fromiter(chain.from_iterable(ids), np.int64)])

    def _gather(self, piece_ids: np.ndarray) -> np.ndarray:
        lens = self._len[piece_ids]
        ends = np.cumsum(lens)
        shift = np.repeat(self._start[piece_ids] - (ends - lens), lens)
        return self._flat[np.arange(ends[-1] if len(ends) else 0) + shift]


def _cut(text: str, cut: re.Pattern) -> list[str]:
    """``text`` split before the second-to-last character of each match of ``cut``."""
    bounds = [0, *(m.end() - 2 for m in cut.finditer(text)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _framing(tokenizer, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids before and after each document: the special tokens the tokenizer's post-processor adds
    around a text (``encode(text, add_special_tokens=True)``: Llama's BOS, a template's BOS and EOS), then
    the end-of-document token unless they already end with it."""
    probe = tokenizer.encode(tokenizer.id_to_token(eos_id), add_special_tokens=True)
    text = [k for k, s in enumerate(probe.sequence_ids) if s is not None]
    start, end = probe.ids[:text[0]], probe.ids[text[-1] + 1:]
    return np.array(start, np.int64), np.array(end if end[-1:] == [eos_id] else end + [eos_id], np.int64)


def _gpt2_like(tokenizer) -> bool:
    """Whether the short cut gives this tokenizer's ids: GPT-2's pipeline, any BPE vocab and merges."""
    spec = json.loads(tokenizer.to_str())
    pre, model, post = spec.get("pre_tokenizer") or {}, spec.get("model") or {}, spec.get("post_processor")
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
            and model.get("type") == "BPE" and model.get("dropout") is None
            and (post is None or post.get("type") == "ByteLevel"))


def _byte_level_chars() -> dict:
    """str.translate table of ASCII to the characters the ByteLevel pre-tokenizer maps them to."""
    from tokenizers import pre_tokenizers
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return {b: byte_level.pre_tokenize_str(chr(b))[0][0] for b in range(128)}


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
        raise UsageError(f"--tokenizer {path}: not a readable tokenizer.json ({exc})") from None


def char_tokenizer(texts):
    """A character-level tokenizer (nanoGPT's shakespeare_char vocabulary): the end-of-document token
    (id 0) and every distinct character of ``texts`` (an iterable of documents), in code point order
    (ids 1..). Encoding splits text into single characters; a character outside the vocabulary becomes
    the end-of-document token. Decoding joins the characters back."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = set()
    for text in texts:
        chars.update(text)
    if not chars:
        raise UsageError("--chars: the documents hold no characters")
    vocab = {EOS_TOKEN: 0, **{c: i for i, c in enumerate(sorted(chars - {EOS_TOKEN}), start=1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS_TOKEN])
    return tok


def train_bpe(texts, vocab_size: int, progress: bool = True, length: int | None = None):
    """Train a GPT-2-style byte-level BPE on ``texts`` (an iterable of documents); EOS is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 257:
        raise UsageError(f"--train-bpe {vocab_size}: a byte-level BPE needs a vocab of at least 257 "
                         f"(256 bytes + the end-of-document token)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok
