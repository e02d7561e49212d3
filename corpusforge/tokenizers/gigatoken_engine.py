"""The gigatoken engine: one tokenizer class over gigatoken's Rust batch encoder, and the load-time check that
decides whether engine="auto" may use it.

gigatoken gives the reference libraries' tokens several times faster, but reads BPE only and could silently
mistokenize a tokenizer.json feature it does not know: `load_checked` tokenizes a probe set of awkward strings
with both engines and refuses gigatoken (raises `Unsupported`) at the first difference. Each format module
(tiktoken_format, hf_format, sentencepiece_format) says how gigatoken loads its files.

Example:
    >>> giga = load_checked(HFFormat(source), threads=False)  # doctest: +SKIP
    >>> giga.backend
    'gigatoken'
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from corpusforge.errors import first_line
from corpusforge.jsonl_field import SEPARATOR, JoinedTexts
from corpusforge.tokenizers import flat_rows
from corpusforge.tokenizers.base import BaseTokenizer, Format, Identity, TokenizerError

__all__ = ["PROBE_TEXTS", "GigatokenTokenizer", "Unsupported", "load_checked"]


class Unsupported(Exception):
    """gigatoken cannot load this tokenizer, or would tokenize it differently from the reference."""


# Strings that catch a wrong split regex, normalizer or special-token rule. Extended per file with its
# added tokens.
PROBE_TEXTS = [
    "",
    "Hello, world! It's a test: don't we'll they've I'M 1234567 3.14159 +1-555-0100",
    "def f(x):\n\treturn x  **  2\r\n\r\n    # comment\n\n\n",
    "   leading and trailing spaces   ",
    "tabs\t\tand\u00a0nbsp\u2003em space\u200bzero width",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 flags 🇫🇷",
    "combining e\u0301 a\u0308 n\u0303 ﬁ ligature Ａ fullwidth ℌ",
    "RTL: مرحبا بالعالم שלום עולם",
    "<|endoftext|> <s> </s> <unk> <pad> <|fim_prefix|><|fim_middle|><|fim_suffix|><|endofprompt|>",
    "a" * 300 + " " + "ab" * 200,
    "0000000000000000000000000 9999",
    "MixedCASEWords camelCase snake_case kebab-case URL https://example.com/path?q=1&b=2",
]


class GigatokenTokenizer(BaseTokenizer):
    """gigatoken: the Rust batch encoder. Flat ids and offsets are taken from its awkward buffers, no copy."""

    backend = "gigatoken"

    def __init__(
        self,
        identity: Identity,
        threads: bool,
        tokenizer,
        decode_overrides: dict[int, bytes],
        decoder: Callable[[bool], BaseTokenizer] | None = None,
    ) -> None:
        super().__init__(identity, threads)
        self._tok = tokenizer
        self._known = int(tokenizer.vocab_size)  # ids gigatoken itself can decode
        # Ids whose text we supply: the special tokens gigatoken was loaded without.
        self._overrides = decode_overrides
        self._make_decoder = decoder  # when set, decode with this reference instead (see the package docstring)
        self._decoder: BaseTokenizer | None = None
        self._override_ids = np.array(sorted(decode_overrides), dtype=np.int64)
        self.probe_texts: list[str] = []  # extra texts for the load-time check (a model's own added pieces)
        self._joined_ok = True  # whether gigatoken takes JoinedTexts' 0xFF separator (not for SentencePiece)

    def _parallel(self) -> bool:
        # A rayon pool built before os.fork has no threads in the child: using it there hangs forever.
        from gigatoken import _parallel

        return self.threads and not getattr(_parallel, "_forked_child", False)

    def _encode(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """A list of str, a gigatoken BytesSource, or an awkward array of strings (the Arrow path)."""
        parallel = self._parallel()
        if not parallel and type(texts).__module__.partition(".")[0] != "awkward" and flat_rows.usable():
            # Single-threaded (a worker process): skip awkward's import, 0.2 s a run (see tokenizers/flat_rows.py).
            rows = flat_rows.flat_rows(lambda: self._tok.encode_batch(texts, parallel=False))
            if rows is not None:
                return rows
        import awkward as ak

        array = self._tok.encode_batch(texts, parallel=parallel)
        layout = ak.to_layout(array)
        if isinstance(layout, ak.contents.ListOffsetArray) and isinstance(layout.content, ak.contents.NumpyArray):
            offsets = np.asarray(layout.offsets.data)
            flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]]
            return flat, np.diff(offsets).astype(np.int64, copy=False)
        return np.asarray(ak.flatten(array), dtype=np.uint32), np.asarray(ak.num(array), dtype=np.int64)

    def _encode_joined(self, texts: JoinedTexts) -> tuple[np.ndarray, np.ndarray]:
        # gigatoken splits the buffer at the separator itself, during the encode: no str per document. Its
        # SentencePiece backend refuses a separator that is not UTF-8 (0xFF never is): that one takes str.
        from gigatoken import BytesSource

        if self._joined_ok:
            try:
                flat, lengths = self._encode(BytesSource(texts.data, separator=SEPARATOR))
            except ValueError as e:
                if "separator" not in str(e):
                    raise
                self._joined_ok = False
            else:
                if len(lengths) != len(texts):  # BytesSource skips empty pieces; the extractor never makes one
                    raise TokenizerError(f"gigatoken returned {len(lengths)} documents for {len(texts)}")
                return flat, lengths
        return self._encode(texts.to_pylist())

    def _encode_arrow(self, texts) -> tuple[np.ndarray, np.ndarray]:
        # gigatoken reads the Arrow UTF-8 buffers in place, as an awkward array of strings: no str per document
        # and no str -> UTF-8 conversion, which cost a quarter of the encode time.
        import awkward as ak
        import pyarrow as pa

        if texts.null_count:
            return self.encode_batch(texts.to_pylist())
        wide = pa.types.is_large_string(texts.type)
        width = 8 if wide else 4
        _, offsets_buf, data_buf = texts.buffers()
        offsets = np.frombuffer(offsets_buf, np.int64 if wide else np.int32, len(texts) + 1, texts.offset * width)
        content = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        layout = ak.contents.ListOffsetArray(
            ak.index.Index64(offsets.astype(np.int64, copy=False)),
            ak.contents.NumpyArray(content, parameters={"__array__": "char"}),
            parameters={"__array__": "string"},
        )
        return self._encode(ak.Array(layout))

    def _decode(self, ids: np.ndarray) -> str:
        if self._make_decoder is not None:
            self._decoder = self._decoder or self._make_decoder(False)
            return self._decoder._decode(ids)
        special = np.isin(ids, self._override_ids)
        unknown = (ids >= self._known) & ~special
        if unknown.any():  # gigatoken panics on these; the reference raises
            raise TokenizerError(f"token id {int(ids[unknown][0])} is not a token of {self.name}")
        if not special.any():
            return self._tok.decode(ids.astype(np.uint32)).decode("utf-8", errors="replace")
        parts, start = [], 0
        for i in np.flatnonzero(special):
            if i > start:
                parts.append(self._tok.decode(ids[start:i].astype(np.uint32)))
            parts.append(self._overrides[int(ids[i])])
            start = i + 1
        if start < len(ids):
            parts.append(self._tok.decode(ids[start:].astype(np.uint32)))
        return b"".join(parts).decode("utf-8", errors="replace")


def _check_same(giga: GigatokenTokenizer, reference: BaseTokenizer, probes: list[str]) -> None:
    for text in probes + giga.probe_texts:
        a, b = giga.encode_batch([text])[0], reference.encode_batch([text])[0]
        if not np.array_equal(a.astype(np.int64), b.astype(np.int64)):
            raise Unsupported(f"gigatoken tokenizes {text[:40]!r} differently from {reference.backend}")


def load_checked(fmt: Format, threads: bool) -> BaseTokenizer:
    """`fmt`'s gigatoken tokenizer, after it tokenized `fmt.probes` as the reference does; else Unsupported.

    A file the reference refuses raises TokenizerError (an error, not a reason to fall back).

    Example:
        >>> load_checked(SentencePieceFormat(source), threads=True).threads  # doctest: +SKIP
        True
    """
    # The reference first: a file the reference refuses is an error, not a fallback. No probes: nothing to check.
    reference = fmt.reference(False) if fmt.probes else None
    try:
        # The check runs on this thread: a caller about to fork workers must not have started a thread pool.
        giga = fmt.gigatoken(False)
        if reference is not None:
            _check_same(giga, reference, fmt.probes)
        giga.threads = threads
    except Unsupported:
        raise
    except BaseException as e:  # gigatoken's Rust side raises ValueError, or pyo3's PanicException
        if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit | TokenizerError):
            raise
        raise Unsupported(first_line(e)) from None
    return giga
