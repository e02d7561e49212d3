"""Hugging Face tokenizer.json files: what the file says about itself, and its tokenizer on `tokenizers` and on
gigatoken.

Special added tokens ("<|endoftext|>", "<s>") inside a document are encoded as text on both engines; added
tokens not marked special are vocabulary and still matched, as `tokenizers` does. gigatoken reads byte-level
BPE only; other models (Unigram, WordPiece, WordLevel) always use `tokenizers`.

Example:
    >>> fmt = HFFormat(Source("tokenizers", "/tok/tokenizer.json", path, path.read_bytes()))  # doctest: +SKIP
    >>> fmt.identity.eod_id  # doctest: +SKIP
    0
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.errors import first_line
from corpusforge.tokenizers.base import BaseTokenizer, Format, Identity, Source, TokenizerError, flatten_lists
from corpusforge.tokenizers.gigatoken_engine import PROBE_TEXTS, GigatokenTokenizer, Unsupported

__all__ = ["HFFormat", "HFReference"]

_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # the special tokens eod_id looks for first


def _hf_config(source: Source) -> dict[str, Any]:
    try:
        config = json.loads(source.data)
        model = config["model"]
        model["vocab"]  # noqa: B018 - every model type has one
    except (ValueError, KeyError, TypeError):
        raise TokenizerError(
            f"{source.path} is not a Hugging Face tokenizer.json (no model.vocab); pass the tokenizer.json "
            "that `tokenizers.Tokenizer.save` or `transformers` `save_pretrained` writes"
        ) from None
    return config


def _hf_vocab_size(config: dict[str, Any]) -> int:
    vocab = config["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list of pieces
    ids += [int(t["id"]) for t in config.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def _hf_eod_id(config: dict[str, Any], path: Path) -> int | None:
    added = {str(t["content"]): int(t["id"]) for t in config.get("added_tokens") or []}
    specials = {str(t["content"]): int(t["id"]) for t in config.get("added_tokens") or [] if t.get("special")}
    for name in _EOD_NAMES:
        if name in specials:
            return specials[name]
    eos = _config_eos(path.parent / "tokenizer_config.json")
    vocab = config["model"]["vocab"]
    ids = added | (vocab if isinstance(vocab, dict) else {})
    if eos in ids:
        return ids[eos]
    return next(iter(specials.values())) if len(specials) == 1 else None


def _config_eos(path: Path) -> str | None:
    """eos_token of a transformers tokenizer_config.json (a string, or an AddedToken dict), if there is one."""
    try:
        eos = json.loads(path.read_bytes()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


class HFReference(BaseTokenizer):
    """`tokenizers` itself: no BOS/EOS from the post-processor, special-token text encoded as text, the file's
    truncation and padding switched off."""

    backend = "tokenizers"

    def __init__(self, identity: Identity, threads: bool, source: Source) -> None:
        import tokenizers

        super().__init__(identity, threads)
        try:
            self._tok = tokenizers.Tokenizer.from_str(source.data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"tokenizers cannot load {source.path}: {first_line(e)}") from None
        self._tok.no_truncation()  # a max_length stored in the file would silently cut documents
        self._tok.no_padding()
        self._tok.encode_special_tokens = True  # "<|endoftext|>" inside a document is text

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.threads:
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        else:  # one document at a time on this thread, never tokenizers' rayon pool
            encodings = [self._tok.encode(t, add_special_tokens=False) for t in texts]
        return flatten_lists([e.ids for e in encodings])

    def _decode(self, ids: np.ndarray) -> str:
        return self._tok.decode(ids.tolist(), skip_special_tokens=False)


class HFFormat(Format):
    """A tokenizer.json: eod_id is the first special "<|endoftext|>", "<|end_of_text|>", "</s>" or "<eos>", else
    eos_token of a tokenizer_config.json beside it, else the special token when there is exactly one."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.config = _hf_config(source)
        self.identity = Identity.of(source, _hf_vocab_size(self.config), _hf_eod_id(self.config, source.path))
        self.added = self.config.get("added_tokens") or []
        self.probes = PROBE_TEXTS + [f"x {t['content']} y{t['content']}z" for t in self.added[:64]]

    def reference(self, threads: bool) -> HFReference:
        return HFReference(self.identity, threads, self.source)

    def gigatoken(self, threads: bool) -> GigatokenTokenizer:
        import gigatoken

        model_type = self.config["model"].get("type", "BPE")
        if model_type != "BPE":
            raise Unsupported(f"gigatoken reads BPE models only, this is {model_type}")
        # Special added tokens out, so that their text in a document is encoded as text (the package docstring).
        stripped = dict(self.config, truncation=None, padding=None)
        stripped["added_tokens"] = [t for t in self.added if not t.get("special")]
        tok = gigatoken.Tokenizer.from_json(json.dumps(stripped))
        # gigatoken's decoders differ from the file's (a leading space per sequence): decode with the reference.
        return GigatokenTokenizer(self.identity, threads, tok, {}, decoder=self.reference)
