"""sentencepiece .model files: their tokenizer on sentencepiece and on gigatoken.

Plain `encode` without BOS/EOS: control symbols ("<s>", "</s>", "<|endoftext|>" when trained as control/eos) in
text are ordinary text, user-defined symbols are matched, exactly as sentencepiece does. gigatoken reads BPE
models with byte_fallback (loaded minus their control pieces); unigram models always use sentencepiece.

Example:
    >>> fmt = SentencePieceFormat(Source("sentencepiece", "/tok/tok.model", path, path.read_bytes()))  # doctest: +SKIP
    >>> fmt.reference(threads=False).encode_batch(["hello"])  # doctest: +SKIP
    (array([ 312, 1045], dtype=uint32), array([2]))
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from corpusforge.errors import first_line
from corpusforge.tokenizers.base import BaseTokenizer, Format, Identity, Source, TokenizerError, flatten_lists
from corpusforge.tokenizers.gigatoken_engine import PROBE_TEXTS, GigatokenTokenizer, Unsupported

__all__ = ["SentencePieceFormat", "SentencePieceReference"]


def _sentencepiece(data: bytes, path: Path):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, TypeError, OSError) as e:
        raise TokenizerError(f"{path} is not a sentencepiece model ({first_line(e)}); pass a .model file") from None


class SentencePieceReference(BaseTokenizer):
    """sentencepiece itself; control ids decode to ""."""

    backend = "sentencepiece"

    def __init__(self, identity: Identity, threads: bool, source: Source) -> None:
        super().__init__(identity, threads)
        self._sp = _sentencepiece(source.data, source.path)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        num_threads = (os.cpu_count() or 1) if self.threads else 1
        return flatten_lists(self._sp.encode(texts, out_type=int, num_threads=num_threads))

    def _decode(self, ids: np.ndarray) -> str:
        return self._sp.decode(ids.tolist())


class SentencePieceFormat(Format):
    """A sentencepiece model: vocab_size is its piece count, eod_id its eos id (None if it has none)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        sp = _sentencepiece(source.data, source.path)
        eos = sp.eos_id()
        self.identity = Identity.of(source, sp.get_piece_size(), eos if eos >= 0 else None)
        control = [i for i in range(sp.get_piece_size()) if sp.is_control(i)]
        self.probes = PROBE_TEXTS + [f"x {sp.id_to_piece(i)} y{sp.id_to_piece(i)}z" for i in control[:64]]

    def reference(self, threads: bool) -> SentencePieceReference:
        return SentencePieceReference(self.identity, threads, self.source)

    def gigatoken(self, threads: bool) -> GigatokenTokenizer:
        import gigatoken
        from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

        try:
            config = json.loads(sentencepiece_to_tokenizer_json(self.source.data))
        except ValueError as e:  # unigram, no byte_fallback, ...
            raise Unsupported(str(e)) from None
        # Control pieces out: sentencepiece never matches them in text. User-defined pieces stay, as there.
        user = [t for t in config["added_tokens"] if not t.get("special")]
        config["added_tokens"] = user
        tok = gigatoken.Tokenizer.from_json(json.dumps(config))
        # gigatoken's decoder differs from sentencepiece's (a leading space per sequence): decode with the reference.
        giga = GigatokenTokenizer(self.identity, threads, tok, {}, decoder=self.reference)
        giga.probe_texts = [f"x {t['content']} y{t['content']}z" for t in user[:64]]
        return giga
