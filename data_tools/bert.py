"""BERT pre-training samples from text, as Google's create_pretraining_data.py makes them.

Input format (Google's): one sentence per line, a blank line between documents; each file
starts a new document. Per document and per duplicate (``dupe_factor``): chunks of sentences
up to a target length (``seq_len - 3``, or with ``short_seq_prob`` a random shorter one), cut
into A and B at a random sentence; with probability 1/2 (always for a one-sentence chunk) B is
taken from a random other document instead (label 1, else 0), the unused sentences going back;
the pair truncated to fit, randomly at the front or back of the longer side; ``[CLS] A [SEP]
B [SEP]``; then ``round(len * masked_lm_prob)`` tokens (at least 1, at most
``max_predictions``) other than [CLS]/[SEP] are predicted: 80% become [MASK], 10% a random
non-special token, 10% stay.

Randomness: one NumPy generator per (seed, duplicate, document) and one for the final shuffle,
so the samples depend on the seed and the input only (not on the tokenizer's thread count).

Sample tensors (int64, ONNX Runtime's BERT names; see trainrun/models/bert.py): input_ids,
segment_ids, input_mask [seq_len] (padding: id 0 = [PAD], mask 0, segment 0);
masked_lm_positions, masked_lm_ids [max_predictions] (unused slots 0, 0); next_sentence_labels [].
"""

from __future__ import annotations

import json

import numpy as np

from trainrun.errors import UsageError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")     # [PAD] must be id 0


def train_wordpiece(texts, vocab_size: int, progress: bool = True, length: int | None = None):
    """Train BERT's WordPiece (uncased: BertNormalizer, BertPreTokenizer) on the documents ``texts()``
    returns (called twice); [PAD] is id 0.

    tokenizers' trainer numbers the "##" continuation characters in the order of a hash map, another
    in each process, and breaks ties between equally frequent merges by id (huggingface/tokenizers
    #1794). So a first pass (no merges) finds them, and the training proper gets them sorted, as
    special tokens after :data:`SPECIALS`, at fixed ids; then they are made plain vocabulary again."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    if vocab_size <= len(SPECIALS):
        raise UsageError(f"--train-wordpiece {vocab_size}: needs more than the {len(SPECIALS)} special tokens")

    def train(size, specials, show):
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=specials, show_progress=show)
        tok.train_from_iterator(texts(), trainer=trainer, length=length)
        return tok
    continuing = sorted(t for t in train(0, list(SPECIALS), False).get_vocab() if t.startswith("##"))
    spec = json.loads(train(vocab_size, [*SPECIALS, *continuing], progress).to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIALS]
    return Tokenizer.from_str(json.dumps(spec))


class Vocab:
    """The ids the sampler needs, checked: [CLS], [SEP], [MASK] present, [PAD] = 0."""

    def __init__(self, tokenizer, where: str):
        ids = {t: tokenizer.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise UsageError(f"{where}: the tokenizer has no {', '.join(missing)} token (a BERT WordPiece "
                             f"tokenizer.json has [PAD] [UNK] [CLS] [SEP] [MASK])")
        if ids["[PAD]"] != 0:
            raise UsageError(f"{where}: [PAD] is id {ids['[PAD]']}; BERT data needs it at id 0 (padding and "
                             f"unused prediction slots are 0)")
        self.cls, self.sep, self.mask = ids["[CLS]"], ids["[SEP]"], ids["[MASK]"]
        self.size = tokenizer.get_vocab_size(with_added_tokens=True)
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special} | set(ids.values())
        self.normal = np.array([i for i in range(self.size) if i not in special], np.int64)


def with_template(tokenizer, vocab: Vocab) -> None:
    """Give ``tokenizer`` BERT's post-processor where it has none: [CLS] A [SEP] (B [SEP]), type ids 0 then
    1, as the samples are made; so the tokenizer.json, in transformers too, encodes text as the data hold it."""
    from tokenizers import processors
    if tokenizer.post_processor is None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab.cls), ("[SEP]", vocab.sep)])


def documents(texts, tokenizer) -> list[list[np.ndarray]]:
    """Each text split into documents (blank lines) of sentences (lines), tokenized; empty ones dropped."""
    docs, lines = [], []
    for text in texts:
        doc = []
        for line in text.splitlines() + [""]:
            line = line.strip()
            if line:
                doc.append(line)
            elif doc:
                docs.append(doc)
                doc = []
    if not docs:
        return []
    flat = [line for doc in docs for line in doc]
    lines = [np.asarray(e.ids, np.int64) for e in tokenizer.encode_batch(flat, add_special_tokens=False)]
    out, k = [], 0
    for doc in docs:
        sentences = [s for s in lines[k:k + len(doc)] if s.size]
        k += len(doc)
        if sentences:
            out.append(sentences)
    return out


def instances(docs, vocab: Vocab, seq_len: int, max_predictions: int, masked_lm_prob: float,
              short_seq_prob: float, dupe_factor: int, seed: int):
    """Yield the samples of ``docs`` (see the module doc), shuffled."""
    made = []
    for dupe in range(dupe_factor):
        for d in range(len(docs)):
            rng = np.random.default_rng([seed, dupe, d])
            made.extend(_from_document(docs, d, vocab, seq_len, max_predictions, masked_lm_prob, short_seq_prob, rng))
    order = np.random.default_rng([seed, dupe_factor, len(docs)]).permutation(len(made))
    for i in order.tolist():
        yield made[i]


def _from_document(docs, d, vocab, seq_len, max_predictions, masked_lm_prob, short_seq_prob, rng):
    doc, max_tokens = docs[d], seq_len - 3
    target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
    chunk, length, i = [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            a = list(chunk[:a_end])
            random_next = len(docs) > 1 and (len(chunk) == 1 or rng.random() < 0.5)
            if random_next:
                want = target - sum(map(len, a))
                other = d
                for _ in range(10):
                    other = int(rng.integers(0, len(docs)))
                    if other != d:
                        break
                if other == d:
                    random_next = False
            if random_next:
                src = docs[other]
                start = int(rng.integers(0, len(src)))
                b = []
                for s in src[start:]:
                    b.append(s)
                    if sum(map(len, b)) >= want:
                        break
                i -= len(chunk) - a_end          # the unused sentences go back
            else:
                b = list(chunk[a_end:])
            tokens_a = np.concatenate(a) if a else np.zeros(0, np.int64)
            tokens_b = np.concatenate(b) if b else np.zeros(0, np.int64)
            tokens_a, tokens_b = _truncate(tokens_a, tokens_b, max_tokens, rng)
            if tokens_a.size and tokens_b.size:
                yield _sample(tokens_a, tokens_b, random_next, vocab, seq_len, max_predictions, masked_lm_prob, rng)
            chunk, length = [], 0
        i += 1


def _truncate(a, b, max_tokens, rng):
    front = [0, 0]
    ends = [len(a), len(b)]
    while ends[0] - front[0] + ends[1] - front[1] > max_tokens:
        k = 0 if ends[0] - front[0] > ends[1] - front[1] else 1
        if rng.random() < 0.5:
            front[k] += 1
        else:
            ends[k] -= 1
    return a[front[0]:ends[0]], b[front[1]:ends[1]]


def _sample(a, b, random_next, vocab, seq_len, max_predictions, masked_lm_prob, rng):
    tokens = np.concatenate([[vocab.cls], a, [vocab.sep], b, [vocab.sep]]).astype(np.int64)
    n = len(tokens)
    segments = np.zeros(seq_len, np.int64)
    segments[len(a) + 2:n] = 1
    candidates = np.concatenate([np.arange(1, len(a) + 1), np.arange(len(a) + 2, n - 1)])
    k = min(max_predictions, max(1, int(round(n * masked_lm_prob))))
    positions = np.sort(rng.permutation(candidates)[:k])
    originals = tokens[positions].copy()
    for p in positions.tolist():
        r = rng.random()
        if r < 0.8:
            tokens[p] = vocab.mask
        elif r < 0.9:
            tokens[p] = vocab.normal[int(rng.integers(0, len(vocab.normal)))]
    ids = np.zeros(seq_len, np.int64)
    ids[:n] = tokens
    mask = np.zeros(seq_len, np.int64)
    mask[:n] = 1
    pos_out, ids_out = np.zeros(max_predictions, np.int64), np.zeros(max_predictions, np.int64)
    pos_out[:k], ids_out[:k] = positions, originals
    return {"input_ids": ids, "segment_ids": segments, "input_mask": mask, "masked_lm_positions": pos_out,
            "masked_lm_ids": ids_out, "next_sentence_labels": np.array(int(random_next), np.int64)}
