"""Fill-in-the-middle (FIM) for GPT samples, sample for sample as Megatron-LM's GPTFIMDataset.

Megatron-LM HEAD (megatron/training/datasets/fim_dataset.py at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553;
not in the megatron-core package) rewrites each sample's text (seq_length + 1 tokens as read) before the tokens,
labels and masks are made from it. `FIMDataset` wraps a corpusforge `GPTDataset` and does the same; the tokens,
labels, loss mask and position ids are then made from the rewritten text exactly as for plain samples. Per sample:

1. The text is cut at every FIM eod token. Each non-empty piece before an eod is rewritten (step 2) and followed
   by the eod; an eod after an empty piece (a leading eod, the second of two) is dropped, and the sample comes
   out one token shorter; the piece after the last eod is always rewritten, even when empty (it may become the
   three sentinels alone).
2. A piece: without `fim_split_sample`, permute(piece, fim_rate). With it: a piece without the split token is
   permute(piece, fim_rate); otherwise one Bernoulli(fim_rate) draw decides whether its fragments are touched at
   all, and if so each non-empty fragment between split tokens (and the last one, even empty) is
   permute(fragment, fim_fragment_rate), the split tokens kept between them.
3. permute(tokens, p): a Bernoulli(p) draw; on 1 the tokens are decoded to text without special tokens; text
   starting with `fim_no_prefix` is left as it was; else two character positions drawn with randint(0, len + 1,
   size=2) and sorted cut the text into prefix, middle, suffix, each encoded on its own; a Bernoulli(fim_spm_rate)
   draw picks SPM `<prefix> <suffix> suffix <middle> prefix middle` over PSM `<prefix> prefix <suffix> suffix
   <middle> middle`.
4. The result is cut to the text's length, or padded with the FIM pad token.

Every draw comes from one numpy `RandomState`, in that order. Megatron keeps one RandomState(seed) per dataset
object and draws as samples are asked for, so its sample i depends on which samples that process read before
(and on DataLoader workers, each a copy of the state). `rng="megatron"` does the same (equal to Megatron's samples
for the same access order); `rng="sample"` (the default) reseeds the RandomState with (seed, i) for sample i, so a
sample is the same whatever the order, the workers and the resumes (the contract of every corpusforge loader).
Both are compared with Megatron's own code in tests/data/test_fim.py (benchmarks/megatron_fim_reference.py).

Megatron decodes and encodes with its HuggingFaceTokenizer (include_special_tokens=True, the default at HEAD);
`FIMTokenizer` does the same from a Hugging Face tokenizer.json with the `tokenizers` library: encoding is
`tokenizer(text).input_ids` (the post-processor's special tokens added, added tokens' text matched), decoding
drops the special tokens (transformers' all_special_tokens: those tokenizer_config.json names, plus any given, as
Megatron's FIM test gives the FIM tokens) and joins the rest with the file's decoder (`convert_tokens_to_string`).
Where corpusforge's gigatoken engine gives the same ids it encodes instead (FIMTokenizer's docstring).

Example:
    >>> fim = FIMDataset(train, FIMConfig(fim_rate=0.5, fim_spm_rate=0.5), FIMTokenizer("tok/tokenizer.json"))
    >>> fim.get_batch([0, 1])["tokens"].shape
    (2, 2048)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.data.batch import RawBatch, assemble
from corpusforge.errors import ArgumentError

RNG_MODES = ("sample", "megatron")


@dataclass(frozen=True)
class FIMConfig:
    """Megatron-LM's FIM options, with its names (megatron/training/arguments.py: --fim-rate is args.fim_rate), its
    meanings and its defaults; `seed` and `rng` are corpusforge's."""

    fim_rate: float = 0.5
    """Probability that a piece (or, with fim_split_sample, a piece holding the split token) is rewritten
    (--fim-rate)."""

    fim_spm_rate: float = 0.5
    """Probability that a rewritten piece is laid out SPM rather than PSM (--fim-spm-rate)."""

    fim_split_sample: str | None = None
    """A token (one vocabulary entry) at which a sample is cut into fragments rewritten one by one, e.g. a file
    separator when a document is a repository (--fim-split-sample)."""

    fim_fragment_rate: float | None = None
    """Probability that each fragment is rewritten; needed with fim_split_sample (--fim-fragment-rate)."""

    fim_no_prefix: str | None = None
    """Text that keeps a piece whose decoded text starts with it as it is (--fim-no-prefix)."""

    fim_prefix_token: str = "<fim_prefix>"
    """(--fim-prefix-token)"""

    fim_middle_token: str = "<fim_middle>"
    """(--fim-middle-token)"""

    fim_suffix_token: str = "<fim_suffix>"
    """(--fim-suffix-token)"""

    fim_pad_token: str = "<fim_pad>"
    """Pads a sample the rewrite made shorter (--fim-pad-token)."""

    fim_eod_token: str = "<|endoftext|>"
    """The end of a document: pieces between two are rewritten separately (--fim-eod-token)."""

    seed: int | None = None
    """Seed of the draws; None: the dataset's seed (Megatron: random_seed)."""

    rng: str = "sample"
    """"sample": sample i's draws come from RandomState((seed, i)), the same whatever the order it is read in;
    "megatron": one RandomState(seed) drawn in the order samples are read, as GPTFIMDataset does."""

    def __post_init__(self) -> None:
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ArgumentError(f"{name}={value}: a probability must be within [0, 1]")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise ArgumentError("fim_split_sample needs fim_fragment_rate (--fim-fragment-rate): each fragment's rate")
        if self.rng not in RNG_MODES:
            raise ArgumentError(f"fim rng={self.rng!r}: give one of {', '.join(RNG_MODES)}")

    def tokens(self) -> dict[str, str]:
        """The special tokens by role, as Megatron's fim_extra_tokens."""
        return {
            "prefix": self.fim_prefix_token,
            "middle": self.fim_middle_token,
            "suffix": self.fim_suffix_token,
            "pad": self.fim_pad_token,
            "eod": self.fim_eod_token,
        }


class FIMTokenizer:
    """Decoding and encoding as Megatron's HuggingFaceTokenizer does them for FIM, from a tokenizer.json.

    Decoding drops the special tokens' ids (`special_tokens`: those transformers counts as special for the files,
    plus those given) and joins the rest with the file's decoder: `tokenizers`' own, or for a ByteLevel file the
    tokens' bytes (the same text, tested). Encoding is `tokenizers`' encode (the reference),
    or gigatoken's where corpusforge's tokenizer loader took it for this file (`engine="auto"`: only where it
    reproduced `tokenizers` on a probe set) and the text holds no added token's text (gigatoken reads those as
    text, Megatron's tokenizer matches them) and the file's post-processor adds no tokens: the same ids, ~100x
    faster on the 2,048-token samples of benchmarks/bench_fim.py.

    Example:
        >>> tok = FIMTokenizer("tok/tokenizer.json")
        >>> tok.encode(tok.decode([17, 42]))
        [17, 42]
    """

    def __init__(self, path: str | Path, engine: str = "auto", special_tokens: Sequence[str] = ()) -> None:
        import tokenizers

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            text = path.read_text(encoding="utf-8")
            self._tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file; OSError for a missing one
            raise ArgumentError(f"{path}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None
        self.path, self.engine = path, engine
        self._tok.no_truncation()
        self._tok.no_padding()
        added = json.loads(text).get("added_tokens") or []
        # a token the config names but the vocabulary lacks is one transformers would add: no id of the data has it
        named = [t for t in _named_special_tokens(path.parent) if self._tok.token_to_id(t) is not None]
        self.special_tokens = tuple(dict.fromkeys([*named, *special_tokens]))
        self.special_ids = frozenset(self.token_id(t) for t in self.special_tokens)
        self._added_texts = tuple(t["content"] for t in added)
        self._fast = self._fast_encoder(path, engine)
        self._bytes = None if engine == "reference" else _byte_level_table(json.loads(text), self.special_ids)

    def _fast_encoder(self, path: Path, engine: str) -> Any:
        """corpusforge's gigatoken tokenizer of the file where it gives Megatron's ids (class docstring), else None."""
        if engine == "reference":
            return None
        if self._tok.encode("a", add_special_tokens=True).ids != self._tok.encode("a", add_special_tokens=False).ids:
            return None  # the post-processor adds tokens (BOS/EOS) that gigatoken does not
        from corpusforge.tokenizers import load_tokenizer

        fast = load_tokenizer(path, engine=engine)
        # The engine's own one-text encode: encode_batch's flat-row assembly costs ~350 us a call here, 20x the
        # encoding of a 2,048-token sample's three pieces.
        return fast._tok.encode if fast.backend == "gigatoken" else None

    def token_id(self, token: str) -> int:
        """The id of a token given by its text (Megatron: tokens_to_ids); an error names a missing one."""
        found = self._tok.token_to_id(token)
        if found is None:
            raise ArgumentError(f"{self.path}: no token {token!r}; add it to the tokenizer or name another")
        return int(found)

    def decode(self, ids: Any) -> str:
        """Text of `ids` without special tokens (Megatron: ids_to_text(ids, remove_special_tokens=True): its tokens
        less the special ones, joined by the file's decoder)."""
        ids = np.asarray(ids).tolist()
        table = self._bytes
        if table is not None and (not ids or 0 <= min(ids) and max(ids) < len(table)):
            # the ByteLevel decoder's own work: the tokens' bytes joined, invalid UTF-8 replaced by U+FFFD
            return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        specials = self.special_ids
        return self._tok.decode([i for i in ids if i not in specials], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` (Megatron: text_to_ids with include_special_tokens, i.e. tokenizer(text).input_ids)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_pieces(self, texts: list[str]) -> list[np.ndarray]:
        """encode() of each text, int64, in one call where the fast encoder gives the same ids."""
        if self._fast is not None and not any(a in t for t in texts for a in self._added_texts):
            return [np.asarray(self._fast(t), dtype=np.int64) for t in texts]
        return [np.array(self.encode(t), dtype=np.int64) for t in texts]

    def describe(self) -> dict[str, Any]:
        return {"tokenizer": str(self.path), "special_tokens": list(self.special_tokens)}

    def __reduce__(self):
        # to spawned DataLoader workers as the file to load (the engines' objects do not all pickle)
        return (FIMTokenizer, (self.path, self.engine, self.special_tokens))


# transformers' special-token attributes (SpecialTokensMixin), read from a tokenizer_config.json
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_LISTS = ("additional_special_tokens", "extra_special_tokens")


def _named_special_tokens(directory: Path) -> list[str]:
    """The special tokens transformers' AutoTokenizer gives a tokenizer loaded from `directory` (its
    all_special_tokens): those the tokenizer_config.json names, none without one."""
    config_path = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ArgumentError(f"{config_path}: not readable JSON ({str(e).splitlines()[0]}); fix or remove it") from None
    named = [config.get(k) for k in _NAMED] + [t for k in _LISTS for t in (config.get(k) or [])]
    texts = [t.get("content") if isinstance(t, dict) else t for t in named]
    return [t for t in texts if isinstance(t, str)]


def _byte_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (openai/gpt-2 encoder.py: bytes_to_unicode, which tokenizers'
    ByteLevel uses): printable bytes stand for themselves, the others for chars from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + k): b for k, b in enumerate(others)})
    return chars


def _byte_level_table(config: dict[str, Any], special_ids: frozenset[int]) -> list[bytes] | None:
    """Each id's bytes, b"" for the special tokens, where decoding is ByteLevel alone (GPT-2, Llama 3 and StarCoder
    style files): decoding is then joining bytes, which tokenizers' decode call does ~3x slower from Python. None
    where the file decodes otherwise, or a token is outside the byte-level alphabet (then tokenizers decodes)."""
    decoder = config.get("decoder") or {}
    vocab = dict((config.get("model") or {}).get("vocab") or {})
    if decoder.get("type") != "ByteLevel" or not vocab:
        return None
    for t in config.get("added_tokens") or []:
        vocab.setdefault(t["content"], int(t["id"]))
    alphabet = _byte_to_unicode()
    table = [b""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        try:
            table[i] = b"" if i in special_ids else bytes(alphabet[c] for c in token)
        except KeyError:
            return None
    return table


class FIMTransform:
    """The rewrite of one sample's text (Megatron's _query_document_sample_shuffle_indices after the read).

    Example:
        >>> t = FIMTransform(FIMConfig(fim_rate=1.0), FIMTokenizer("tok/tokenizer.json"))
        >>> t(np.array([5, 6, 7]), np.random.RandomState(1)).shape
        (3,)
    """

    def __init__(self, config: FIMConfig, tokenizer: FIMTokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        ids = {role: tokenizer.token_id(token) for role, token in config.tokens().items()}
        self.prefix_id, self.middle_id, self.suffix_id = ids["prefix"], ids["middle"], ids["suffix"]
        self.pad_id, self.eod_id = ids["pad"], ids["eod"]
        self.split_id = None if config.fim_split_sample is None else tokenizer.token_id(config.fim_split_sample)

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """The rewritten sample, int64, as long as `sample`."""
        breaks = np.flatnonzero(sample == self.eod_id)
        if len(breaks):
            parts, start = [], 0
            for loc in breaks.tolist():
                if loc - start > 0:  # Megatron keeps only the eods that end a non-empty piece
                    parts += [self._split_and_permute(sample[start:loc], rng), [self.eod_id]]
                start = loc + 1
            parts.append(self._split_and_permute(sample[start:], rng))
            out = np.concatenate(parts)
        else:
            out = self._split_and_permute(sample, rng)
        n = len(sample)
        if len(out) >= n:
            return np.asarray(out[:n], dtype=np.int64)
        return np.concatenate([out, np.full(n - len(out), self.pad_id)]).astype(np.int64)

    def _split_and_permute(self, piece: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """Megatron's _fim_split_and_permute_sequence."""
        cfg = self.config
        if self.split_id is None:
            return self._permute(piece, cfg.fim_rate, rng)
        breaks = np.flatnonzero(piece == self.split_id)
        if not len(breaks):
            return self._permute(piece, cfg.fim_rate, rng)
        if not rng.binomial(1, cfg.fim_rate):
            return piece
        parts, start = [], 0
        for loc in breaks.tolist():
            if loc - start > 0:
                parts += [self._permute(piece[start:loc], cfg.fim_fragment_rate, rng), [self.split_id]]
            start = loc + 1
        parts.append(self._permute(piece[start:], cfg.fim_fragment_rate, rng))
        return np.concatenate(parts)

    def _permute(self, piece: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        """Megatron's _permute with truncate_or_pad=False (how GPTFIMDataset calls it)."""
        if not rng.binomial(1, rate):
            return piece
        tok = self.tokenizer
        text = tok.decode(piece)
        if self.config.fim_no_prefix is not None and text.startswith(self.config.fim_no_prefix):
            return piece
        boundaries = sorted(rng.randint(low=0, high=len(text) + 1, size=2).tolist())
        prefix, middle, suffix = tok.encode_pieces(
            [text[: boundaries[0]], text[boundaries[0] : boundaries[1]], text[boundaries[1] :]]
        )
        if rng.binomial(1, self.config.fim_spm_rate):  # SPM, variant 2 of the FIM paper (arXiv:2207.14255)
            return np.concatenate([[self.prefix_id, self.suffix_id], suffix, [self.middle_id], prefix, middle])
        return np.concatenate([[self.prefix_id], prefix, [self.suffix_id], suffix, [self.middle_id], middle])


class FIMDataset:
    """A GPTDataset whose samples are rewritten as Megatron-LM's GPTFIMDataset rewrites them (module docstring).

    Serves what the GPTDataset serves (`ds[i]`, `__getitems__`, `get_batch`, `read_raw` for the loader's workers),
    from the rewritten text; the loader's state carries the FIM options in the fingerprint.

    Example:
        >>> fim = FIMDataset(train, FIMConfig(fim_rate=0.9, fim_split_sample="<file_sep>", fim_fragment_rate=0.5),
        ...                  FIMTokenizer("tok/"))
        >>> loader = make_loader(fim, micro_batch_size=8, num_workers=2)
    """

    def __init__(self, dataset: Any, config: FIMConfig, tokenizer: FIMTokenizer) -> None:
        base = dataset.config
        if dataset.split == "valid" and not base.drop_last_partial_validation_sequence:
            # GPTFIMDataset's read does not pad a short last sample (GPTDataset's does): it serves a short sample
            raise ArgumentError(
                "fim: a validation split with drop_last_partial_validation_sequence=False has a short last sample, "
                "which Megatron's GPTFIMDataset serves short; keep the default (True)"
            )
        if getattr(base, "document_boundaries", False):
            # GPTFIMDataset's read gives one document length per sample ([sample_len]): no boundaries to mask at
            raise ArgumentError(
                "fim: Megatron-LM gives a FIM sample as one document, so document_boundaries would mask nothing; "
                "turn document_boundaries off"
            )
        if config.rng == "megatron" and hasattr(dataset, "datasets"):
            raise ArgumentError(
                "fim rng='megatron' over a blend: Megatron draws from one RandomState per dataset of a blend, in the "
                "order each is read; use rng='sample'"
            )
        self.dataset, self.fim, self.tokenizer = dataset, config, tokenizer
        self.transform = FIMTransform(config, tokenizer)
        self.seed = base.seed if config.seed is None else config.seed
        self._rng = np.random.RandomState(self.seed)
        # Megatron's masks take the pad id from its tokenizer; a FIM pad counts as padding here only where the
        # dataset's pad_token_id says so, as there.
        self.config = base
        self.split = dataset.split

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {**self.dataset.fingerprint, "fim": {**asdict(self.fim), "seed": self.seed, **self.tokenizer.describe()}}

    @property
    def remote(self) -> bool:
        return self.dataset.remote

    def prefetch(self, ids) -> None:
        self.dataset.prefetch(ids)

    def load_kernels(self) -> None:
        load = getattr(self.dataset, "load_kernels", None)
        if load is not None:
            load()

    def rng_for(self, i: int) -> np.random.RandomState:
        """The RandomState sample i draws from: reseeded with (seed, i), or the dataset's running one."""
        if self.fim.rng == "megatron":
            return self._rng
        self._rng.seed([self.seed, int(i)])
        return self._rng

    def rewrite(self, ids: np.ndarray, text: np.ndarray) -> np.ndarray:
        """(B, S + extra) int32 rewritten text of samples `ids` read as `text`, in the order of `ids`."""
        out = np.empty(text.shape, np.int32)
        for row, i in enumerate(ids.tolist()):
            out[row] = self.transform(text[row], self.rng_for(i))
        return out

    def read_raw(self, ids) -> RawBatch:
        # contiguous: a strided id array would make numba compile another specialisation of the gather (~10 s)
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        raw = self.dataset.read_raw(ids)
        return dataclasses.replace(raw, text=self.rewrite(ids, raw.text), maybe_padded=True)

    def get_batch(self, ids) -> dict[str, np.ndarray]:
        return assemble(self.read_raw(ids), self.config)

    def __getitems__(self, ids: list[int]) -> dict[str, Any]:
        return assemble(self.read_raw(ids), self.config, as_torch=True)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.__getitems__([i]).items()}

    def __repr__(self) -> str:
        fim = self.fim
        return f"FIMDataset({self.dataset!r}, fim_rate={fim.fim_rate}, fim_spm_rate={fim.fim_spm_rate}, rng={fim.rng})"


def with_fim(datasets: Any, config: FIMConfig | None, tokenizer: str | Path | FIMTokenizer) -> Any:
    """`datasets` (one, or a (train, valid, test) tuple with Nones) wrapped in FIMDataset; unchanged without config.

    Example:
        >>> train, valid, test = with_fim(build_gpt_datasets(...), FIMConfig(fim_rate=0.5), "tok/tokenizer.json")
    """
    if config is None:
        return datasets
    tok = tokenizer if isinstance(tokenizer, FIMTokenizer) else FIMTokenizer(tokenizer)
    if isinstance(datasets, (tuple, list)):
        return type(datasets)(None if d is None else FIMDataset(d, config, tok) for d in datasets)
    return FIMDataset(datasets, config, tok)
