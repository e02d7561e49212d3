"""Reference FIM samples from Megatron-LM's own GPTFIMDataset, stored for tests/data/test_fim.py.

    python benchmarks/megatron_fim_reference.py [--mirror /work/.mirror/NVIDIA+Megatron-LM/repo] [--rev HEAD]
                                                [--out tests/data/fim_reference]

Megatron-LM's GPTFIMDataset (megatron/training/datasets/fim_dataset.py) is not in the megatron-core package. This
script takes that file, and megatron/core/datasets/gpt_dataset.py of the same commit (whose __getitem__ takes the
three values HEAD's FIM read returns; 0.16.1's takes two), out of a Megatron-LM git directory with `git show`, into
a temporary directory, and imports them over the installed megatron-core 0.16.1 (index builder, indexed dataset,
tokenizers, helpers). Shims, and nothing else:

- `megatron.core.safe_globals.safe_numpy_load` (HEAD's gpt_dataset.py imports it; 0.16.1 lacks it, and HEAD's
  safe_globals.py imports classes 0.16.1 lacks): `numpy.load`, which is what HEAD's function calls, with only
  pickle.load patched, and the index files it loads are plain .npy arrays, never pickles;
- HEAD's gpt_dataset.py is registered as `megatron.core.datasets.gpt_dataset` before fim_dataset.py is loaded, so
  that fim_dataset.py's `from megatron.core.datasets.gpt_dataset import GPTDataset` finds HEAD's class;
- fim_dataset.py is loaded from its file as a module of its own (megatron.training is not installed);
- torch.distributed.get_rank answers 0 without a process group (BlendedDataset-free builds still ask).

The tokenizer is a small byte-level BPE trained here on the generated corpus (tokenizer.json), loaded by Megatron's
MegatronTokenizer (huggingface library) with HEAD's defaults given explicitly (use_fast=True,
include_special_tokens=True) and the FIM tokens as additional special tokens, as Megatron's FIM test loads it;
for the setting "named_specials" from a tokenizer_config.json naming only eod and pad and with no additional special
tokens, as Megatron's training loads it (transformers then keeps the FIM tokens' and <file_sep>'s text when
decoding, and the FIM rewrite moves them).
The corpus: generated code-like "repositories" (files joined by <file_sep>, some starting with "#!", some
non-ASCII text so that byte-level pieces are cut inside characters, special tokens' text inside the text (which
Megatron's encoding makes the special token), documents of 1 token to several samples,
every 7th document encoded a character at a time, so that a rewritten piece re-encodes shorter and is padded).

For every setting, samples 0..N-1 are read in order with Megatron's running RandomState (what rng="megatron"
reproduces) and again with the RandomState reseeded with (seed, i) before sample i (what rng="sample" reproduces:
Megatron's own code drawing from a per-sample seed). Stored: the corpus (tokens and document lengths; the tests
write them as a .bin/.idx pair, which git ignores), and per sample the rewritten text (what the FIM read returns)
and tokens, labels, loss_mask, position_ids (what Megatron's GPTDataset.__getitem__ returns), with the commit,
settings and versions in reference.json. Files are written under temporary names and renamed.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corpusforge.fsutil import write_bytes_atomic, write_json_atomic  # noqa: E402
from corpusforge.indexed import IndexedDatasetWriter  # noqa: E402

MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
FIM_FILE = "megatron/training/datasets/fim_dataset.py"
GPT_FILE = "megatron/core/datasets/gpt_dataset.py"

EOD, PAD, SPLIT = "<|endoftext|>", "<fim_pad>", "<file_sep>"
FIM_TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": PAD, "eod": EOD}
SPECIALS = [EOD, "<fim_prefix>", "<fim_middle>", "<fim_suffix>", PAD, SPLIT]
SEED = 1234
SAMPLES = 48
PREFIX_NAME = "fim_text_document"

# name: (seq_length, fim options, mask options); the FIM options use Megatron's config names.
SETTINGS = {
    "psm": (64, {"fim_rate": 1.0, "fim_spm_rate": 0.0}, {}),
    "spm": (64, {"fim_rate": 1.0, "fim_spm_rate": 1.0}, {}),
    "mixed": (64, {"fim_rate": 0.5, "fim_spm_rate": 0.5}, {"reset_position_ids": True, "eod_mask_loss": True}),
    "split": (
        64,
        {"fim_rate": 0.9, "fim_spm_rate": 0.5, "fim_split_sample": SPLIT, "fim_fragment_rate": 0.5},
        {"reset_position_ids": True, "eod_mask_loss": True},
    ),
    "split_no_prefix": (
        64,
        {
            "fim_rate": 1.0,
            "fim_spm_rate": 0.5,
            "fim_split_sample": SPLIT,
            "fim_fragment_rate": 1.0,
            "fim_no_prefix": "#!",
        },
        {},
    ),
    "no_prefix": (64, {"fim_rate": 1.0, "fim_spm_rate": 0.3, "fim_no_prefix": "#!"}, {}),
    "short": (
        16,
        {"fim_rate": 0.8, "fim_spm_rate": 0.5, "fim_split_sample": SPLIT, "fim_fragment_rate": 0.8},
        {"eod_mask_loss": True},
    ),
    "off": (64, {"fim_rate": 0.0, "fim_spm_rate": 0.5}, {}),
    "named_specials": (64, {"fim_rate": 1.0, "fim_spm_rate": 0.5}, {"reset_position_ids": True}),
}
# the tokenizer directory of a setting (default "tokenizer": every added token special, as Megatron's FIM test)
TOKENIZER_OF = {"named_specials": "tokenizer_named"}
RNG_MODES = ("megatron", "sample")
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")

WORDS = "def return class import self value index data open read write yield lambda None True False".split()
ODD = ["café", "naïve", "中文", "数据", "€", "ß", "🙂", "Ω", "ä"]


def _line(rng: np.random.Generator) -> str:
    words = [str(rng.choice(WORDS)) if rng.random() > 0.15 else str(rng.choice(ODD)) for _ in range(rng.integers(1, 8))]
    if rng.random() < 0.02:  # a special token's text inside the text (encoded as text; re-encoded as the token)
        words.append(str(rng.choice(SPECIALS)))
    indent = "    " * int(rng.integers(0, 3))
    return indent + " ".join(words) + (f"  # {rng.integers(0, 999)}" if rng.random() < 0.3 else "")


def _file(rng: np.random.Generator) -> str:
    head = "#!/usr/bin/env python\n" if rng.random() < 0.25 else ""
    return head + "\n".join(_line(rng) for _ in range(rng.integers(1, 9))) + "\n"


def corpus_texts(seed: int, n: int) -> list[list[str]]:
    """n documents, each a list of 1-4 files (a "repository"); every 9th a one-word document."""
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n):
        if d % 9 == 4:
            docs.append([str(rng.choice(WORDS))])
        else:
            docs.append([_file(rng) for _ in range(rng.integers(1, 5))])
    return docs


def train_tokenizer(out: Path) -> None:
    """A byte-level BPE of 600 entries with the FIM tokens, its file separator and eod as special added tokens."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = ["".join(files) for files in corpus_texts(7, 400)]
    tok.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out / "tokenizer.json", tok.to_str(pretty=False).encode())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD,
        "pad_token": PAD,
        "additional_special_tokens": SPECIALS[1:],
        "model_max_length": 1_000_000,
    }
    write_json_atomic(out / "tokenizer_config.json", config)


def named_tokenizer(source: Path, out: Path) -> None:
    """The same tokenizer.json with a tokenizer_config.json that names only eod and pad: transformers then counts
    only those as special (the FIM tokens and <file_sep> are added tokens it keeps when decoding), as where Megatron's
    training builds its tokenizer without the FIM tokens as additional special tokens."""
    out.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out / "tokenizer.json", (source / "tokenizer.json").read_bytes())
    write_json_atomic(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOD,
            "pad_token": PAD,
            "model_max_length": 1_000_000,
        },
    )


def corpus_tokens(tokenizer_json: Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths) of the token dataset: each document's files encoded and joined by <file_sep>, then eod."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    tok.encode_special_tokens = True  # a special token's text in a document is text, as corpusforge preprocess reads it
    split_id, eod_id = tok.token_to_id(SPLIT), tok.token_to_id(EOD)
    documents = []
    for d, files in enumerate(corpus_texts(11, 220)):
        ids: list[int] = []
        for k, text in enumerate(files):
            if d % 7 == 3:  # encoded a character at a time: re-encoding a piece shortens it, and FIM pads
                encoded = [i for ch in text for i in tok.encode(ch, add_special_tokens=False).ids]
            else:
                encoded = tok.encode(text, add_special_tokens=False).ids
            ids += ([split_id] if k else []) + encoded
        documents.append(ids + [eod_id])
    return np.array([i for doc in documents for i in doc], np.uint16), np.array([len(d) for d in documents], np.int64)


def write_corpus(tokens: np.ndarray, lengths: np.ndarray, prefix: Path) -> str:
    """The token dataset (.bin/.idx) at `prefix` (tests/data/test_fim.py writes it the same way)."""
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(tokens, lengths)
    return str(prefix)


def git_show(mirror: Path, rev: str, path: str, into: Path) -> Path:
    target = into / Path(path).name
    target.write_bytes(subprocess.run(["git", "-C", str(mirror), "show", f"{rev}:{path}"], check=True,
                                      capture_output=True).stdout)  # fmt: skip
    return target


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def megatron_fim_classes(mirror: Path, rev: str, work: Path):
    """(GPTFIMDataset, GPTFIMDatasetConfig) of commit `rev`, over the installed megatron-core (module docstring)."""
    import megatron.core.safe_globals as installed_safe
    import torch.distributed

    torch.distributed.get_rank = lambda *a, **k: 0
    if not hasattr(installed_safe, "safe_numpy_load"):
        installed_safe.safe_numpy_load = np.load
    gpt = _load("megatron.core.datasets.gpt_dataset", git_show(mirror, rev, GPT_FILE, work))
    import megatron.core.datasets as datasets_package

    datasets_package.gpt_dataset = gpt
    fim = _load("megatron_head_fim_dataset", git_show(mirror, rev, FIM_FILE, work))
    return fim.GPTFIMDataset, fim.GPTFIMDatasetConfig


def megatron_tokenizer(directory: Path, additional_special_tokens: list[str] | None = None):
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(directory),
        metadata_path={"library": "huggingface"},
        additional_special_tokens=SPECIALS[1:] if additional_special_tokens is None else additional_special_tokens,
        include_special_tokens=True,
        use_fast=True,
    )


def build_megatron(classes, tokenizer, prefix, cache: Path, seq_length: int, fim: dict, masks: dict, samples=SAMPLES):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    dataset_class, config_class = classes
    config = config_class(
        random_seed=SEED,
        sequence_length=seq_length,
        blend=([str(prefix)], None),
        split="100,0,0",
        path_to_cache=str(cache),
        tokenizer=tokenizer,
        reset_position_ids=masks.get("reset_position_ids", False),
        reset_attention_mask=False,
        eod_mask_loss=masks.get("eod_mask_loss", False),
        create_attention_mask=False,
        fim_extra_tokens=dict(FIM_TOKENS),
        **fim,
    )
    return BlendedMegatronDatasetBuilder(dataset_class, [samples, None, None], lambda: True, config).build()[0]


def read_samples(ds, mode: str) -> dict[str, np.ndarray]:
    """Samples 0..SAMPLES-1 of Megatron's dataset `ds` in order: the FIM read's text and __getitem__'s fields."""
    texts, fields = [], {k: [] for k in FIELDS}
    query = ds._query_document_sample_shuffle_indices
    seen: list[np.ndarray] = []

    def recording(idx):  # the text Megatron's own read returned, as __getitem__ received it
        out = query(idx)
        seen.append(np.array(out[0], copy=True))  # __getitem__ zeroes pad tokens in this very array
        return out

    ds._query_document_sample_shuffle_indices = recording
    for i in range(SAMPLES):
        if mode == "sample":
            ds.np_rng.seed([SEED, i])  # the draws of sample i from RandomState((seed, i)), in Megatron's own code
        item = ds[i]
        texts.append(seen[-1])
        for k in FIELDS:
            fields[k].append(item[k].numpy())
    # Stored small: ids and positions fit uint16 here (a 600-token vocabulary), the loss mask is 0/1
    out = {"text": _exact(np.stack(texts), np.uint16)}
    out.update({k: _exact(np.stack(v), np.uint8 if k == "loss_mask" else np.uint16) for k, v in fields.items()})
    return out


def _exact(values: np.ndarray, dtype) -> np.ndarray:
    cast = values.astype(dtype)
    if not np.array_equal(cast, values):
        raise SystemExit(f"values do not fit {np.dtype(dtype).name}: store them wider")
    return cast


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mirror", type=Path, default=MIRROR, help="a Megatron-LM git directory (bare or not)")
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--out", type=Path, default=ROOT / "tests/data/fim_reference")
    args = p.parse_args()
    commit = subprocess.run(["git", "-C", str(args.mirror), "rev-parse", args.rev], check=True, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(args.out / "tokenizer")
    named_tokenizer(args.out / "tokenizer", args.out / "tokenizer_named")
    tokens, lengths = corpus_tokens(args.out / "tokenizer" / "tokenizer.json")
    arrays: dict[str, np.ndarray] = {"corpus/tokens": tokens, "corpus/lengths": lengths}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        prefix = write_corpus(tokens, lengths, work / PREFIX_NAME)
        classes = megatron_fim_classes(args.mirror, commit, work)
        tokenizers_by_dir = {
            "tokenizer": megatron_tokenizer(args.out / "tokenizer"),
            "tokenizer_named": megatron_tokenizer(args.out / "tokenizer_named", []),
        }
        for name, (seq_length, fim, masks) in SETTINGS.items():
            tokenizer = tokenizers_by_dir[TOKENIZER_OF.get(name, "tokenizer")]
            for mode in RNG_MODES:
                ds = build_megatron(classes, tokenizer, prefix, work / f"cache-{name}-{mode}", seq_length, fim, masks)
                for key, value in read_samples(ds, mode).items():
                    arrays[f"{name}/{mode}/{key}"] = value
                changed = int((arrays[f"{name}/{mode}/text"] != arrays[f"{name}/megatron/text"]).any(1).sum())
                print(f"{name:16s} {mode:8s} seq {seq_length:3d}: {SAMPLES} samples ({changed} differ from megatron)")
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    write_bytes_atomic(args.out / "samples.npz", buffer.getvalue())
    import megatron.core
    import tokenizers
    import transformers

    write_json_atomic(
        args.out / "reference.json",
        {
            "megatron_lm_commit": commit,
            "megatron_lm_files": [FIM_FILE, GPT_FILE],
            "megatron_core": megatron.core.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "made": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/megatron_fim_reference.py",
            "seed": SEED,
            "samples": SAMPLES,
            "documents": len(lengths),
            "split": "100,0,0",
            "fim_tokens": FIM_TOKENS,
            "rng_modes": {
                "megatron": "samples 0..N-1 read in order from one RandomState(seed)",
                "sample": "RandomState reseeded with [seed, i] before sample i",
            },
            "settings": {
                n: {"seq_length": s, **f, **m, "tokenizer": TOKENIZER_OF.get(n, "tokenizer")}
                for n, (s, f, m) in SETTINGS.items()
            },
        },
    )
    print(f"wrote {args.out} (Megatron-LM {commit})")


if __name__ == "__main__":
    main()
