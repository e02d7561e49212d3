"""Make a realistic JSONL corpus for the preprocessing benchmarks, offline and deterministically from a seed.

    python benchmarks/make_corpus.py --size-mb 200 [--seed 1234] [--output benchmarks/work/corpus-200mb-s1234.jsonl]

Each line is `{"text": ..., "id": ...}`. Document sizes are log-normal (median ~2 KB, clipped to
100 B .. 100 KB, like web text); about 70% of documents are prose and 30% code.

The raw material is whatever text this machine already has, so nothing is downloaded:
  code   Python sources of the stdlib and site-packages, C/C++ headers and sources, .pyi stubs;
         a document is a line-aligned window of one file, or several small files concatenated
  prose  /usr/share/common-licenses, /usr/share/doc/**/{copyright,README,changelog,NEWS}(.gz),
         vim's help files, .md/.rst/.txt of site-packages, docstrings and comments of the Python
         sources; a document mixes real paragraphs, paragraphs recombined from real sentences, and
         paragraphs from an order-2 word Markov chain over the same sentences, so the corpus is not
         a few files repeated
  unicode  translations from the gettext .mo catalogues on the machine (dozens of languages), CJK
         sample texts of the stdlib's test suite, and typographic quotes/dashes/emoji in some documents

The same seed gives the same bytes on the same machine (same files, same Python). Another machine
has other files, so other bytes: `<output>.meta.json` records the material's fingerprint.

Reuse: when `<output>` and its `.meta.json` exist with the same parameters the file is kept as it is.
Writing goes to `<output>.tmp` and is renamed when complete, so a killed run leaves no half corpus.
"""

from __future__ import annotations

import argparse
import gettext
import gzip
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

GENERATOR_VERSION = 1  # bump when the output for a given seed changes
WORK_DIR = Path(__file__).resolve().parent / "work"
MB = 1_000_000  # the benchmarks count decimal megabytes


@dataclass(frozen=True)
class CorpusSpec:
    """What the corpus is made of; every field is part of the cache key."""

    size_mb: float
    """Target size of the JSONL file in MB (10^6 bytes); the file ends at the first document past it."""
    seed: int = 1234
    """Seed of every random choice."""
    code_fraction: float = 0.3
    """Share of documents that are source code."""
    median_doc_bytes: int = 2000
    """Median document size; sizes are log-normal around it."""
    sigma: float = 1.2
    """Log-normal shape: 1.2 gives a mean of about twice the median and a long tail."""
    min_doc_bytes: int = 100
    max_doc_bytes: int = 100_000
    version: int = GENERATOR_VERSION


def default_path(spec: CorpusSpec) -> Path:
    return WORK_DIR / f"corpus-{spec.size_mb:g}mb-s{spec.seed}.jsonl"


# ---------------------------------------------------------------------------------------------------------------
# raw material


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _site_packages() -> list[Path]:
    paths = {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}
    return sorted(paths)


def _files(roots: list[Path], suffixes: tuple[str, ...], max_bytes: int = 2_000_000) -> list[Path]:
    """Every file under `roots` whose name ends in one of `suffixes`, sorted so the order is reproducible."""
    found = set()
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            for name in filenames:
                if name.endswith(suffixes):
                    p = Path(dirpath) / name
                    try:
                        if 0 < p.stat().st_size <= max_bytes:
                            found.add(p)
                    except OSError:
                        pass
    return sorted(found)


def _read_text(path: Path, limit: int = 2_000_000) -> str:
    """A file as text (gunzipped when .gz); undecodable bytes are dropped, never invented."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read(limit)
        else:
            with open(path, "rb") as f:
                data = f.read(limit)
    except (OSError, EOFError):
        return ""
    return data.decode("utf-8", errors="ignore").replace("\r\n", "\n").replace("\x00", "")


def _prose_files() -> dict[str, list[Path]]:
    """Prose files by kind, so that no one kind (Debian changelogs are most of the bytes) drowns the others."""
    doc_files = _files([Path("/usr/share/doc")], ("",))
    package_docs = _files(_site_packages(), (".md", ".rst", ".txt"), max_bytes=500_000)
    package_docs = [p for p in package_docs if "LICENSE" not in p.name.upper() and "entry_points" not in p.name]
    return {
        "changelogs": [p for p in doc_files if re.match(r"(changelog|NEWS)", p.name, re.IGNORECASE)],
        "legal": [p for p in doc_files if p.name == "copyright"] + _files([Path("/usr/share/common-licenses")], ("",)),
        "manuals": [p for p in doc_files if p.name.upper().startswith("README")]
        + _files([Path("/usr/share/vim")], (".txt",))
        + package_docs,
    }


# Share of prose paragraphs drawn from each kind of source.
PROSE_WEIGHTS = {"manuals": 0.4, "docstrings": 0.25, "changelogs": 0.2, "legal": 0.15}


_DOCSTRING = re.compile(r'"""(.*?)"""', re.DOTALL)
_COMMENT = re.compile(r"^\s*# ?([A-Za-z].{30,})$", re.MULTILINE)


def _python_prose(py_files: list[Path], rng: random.Random, n_files: int = 3000) -> list[str]:
    """Docstrings and comment blocks of a sample of Python files: real English about real code."""
    out = []
    for path in rng.sample(py_files, min(n_files, len(py_files))):
        text = _read_text(path, 400_000)
        for doc in _DOCSTRING.findall(text):
            out.extend(_paragraphs(_dedent(doc)))
        comments = _COMMENT.findall(text)
        for i in range(0, len(comments), 4):
            out.append(" ".join(comments[i : i + 4]))
    return out


def _dedent(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines())


def _paragraphs(text: str) -> list[str]:
    paras = (p.strip("\n") for p in re.split(r"\n\s*\n", text))
    return [p for p in paras if 40 <= len(p) <= 4000 and sum(c.isalpha() for c in p) > len(p) // 2]


def _foreign_strings() -> list[str]:
    """Translated messages from the machine's gettext catalogues, and the stdlib's CJK sample texts."""
    mo_files = _files([Path("/usr/share/locale"), Path("/usr/share/vim"), *_site_packages()], (".mo",))
    out: list[str] = []
    for path in mo_files[:: max(1, len(mo_files) // 400)]:  # a spread of packages and languages
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog  # the parsed .mo, message -> translation
        except Exception:  # a catalogue gettext cannot parse is simply not used
            continue
        for value in catalog.values():
            if isinstance(value, str) and len(value) >= 12 and any(ord(c) > 127 for c in value):
                out.append(value.strip())
    for path in sorted((_stdlib() / "test" / "cjkencodings").glob("*-utf8.txt")):
        out.extend(_paragraphs(_read_text(path)))
    return sorted(set(out))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def _sentences(paragraphs: list[str]) -> list[str]:
    out = []
    for p in paragraphs:
        flat = " ".join(p.split())
        out.extend(s for s in _SENTENCE_END.split(flat) if 20 <= len(s) <= 400 and s[-1] in ".!?")
    return out


@dataclass
class Material:
    code_files: list[Path]
    c_files: list[Path]
    paragraphs: dict[str, list[str]]  # kind of source -> its distinct paragraphs
    sentences: list[str]  # drawn evenly from every kind
    foreign: list[str]
    chain: dict[tuple[str, str], list[str]]
    starts: list[tuple[str, str]]

    def paragraph(self, rng: random.Random) -> str:
        kinds = [k for k in PROSE_WEIGHTS if self.paragraphs.get(k)]
        kind = rng.choices(kinds, weights=[PROSE_WEIGHTS[k] for k in kinds])[0]
        return rng.choice(self.paragraphs[kind])

    def fingerprint(self) -> dict:
        h = hashlib.sha256()
        for files in (self.code_files, self.c_files):
            h.update("\n".join(map(str, files)).encode())
        for texts in (*self.paragraphs.values(), self.foreign):
            h.update("\n".join(texts).encode())
        return {
            "code_files": len(self.code_files),
            "c_files": len(self.c_files),
            "paragraphs": {k: len(v) for k, v in self.paragraphs.items()},
            "sentences": len(self.sentences),
            "foreign_strings": len(self.foreign),
            "markov_states": len(self.chain),
            "sha256": h.hexdigest()[:16],
        }


def gather_material(rng: random.Random) -> Material:
    roots = [_stdlib(), *_site_packages()]
    py_files = _files(roots, (".py", ".pyi"))
    c_files = _files([Path("/usr/include"), *roots], (".h", ".c", ".cpp", ".hpp", ".cc"))
    paragraphs = {}
    for kind, files in _prose_files().items():
        paragraphs[kind] = sorted({p for path in files for p in _paragraphs(_read_text(path))})
    paragraphs["docstrings"] = sorted(set(_python_prose(py_files, rng)))
    sentences = []
    for kind in sorted(paragraphs):
        kind_sentences = _sentences(paragraphs[kind])
        sentences += rng.sample(kind_sentences, min(len(kind_sentences), 50_000))
    chain, starts = _markov_chain(rng.sample(sentences, min(len(sentences), 60_000)))
    return Material(py_files, c_files, paragraphs, sentences, _foreign_strings(), chain, starts)


# ---------------------------------------------------------------------------------------------------------------
# prose


def _markov_chain(sentences: list[str]) -> tuple[dict[tuple[str, str], list[str]], list[tuple[str, str]]]:
    """Order-2 word chain: (w1, w2) -> every word seen after them (repeats keep the frequencies)."""
    chain: dict[tuple[str, str], list[str]] = {}
    starts = []
    for s in sentences:
        words = s.split()
        if len(words) < 4:
            continue
        starts.append((words[0], words[1]))
        for a, b, c in zip(words, words[1:], words[2:], strict=False):
            chain.setdefault((a, b), []).append(c)
    return chain, starts


def markov_paragraph(m: Material, rng: random.Random, n_words: int) -> str:
    a, b = rng.choice(m.starts)
    words = [a, b]
    while True:
        nxt = m.chain.get((a, b))
        if not nxt:  # a dead end: start a new sentence
            if len(words) >= n_words:
                break
            a, b = rng.choice(m.starts)
            words += [a, b]
            continue
        c = nxt[int(rng.random() * len(nxt))]
        words.append(c)
        a, b = b, c
        if len(words) >= n_words and c[-1:] in (".", "!", "?"):
            break
        if len(words) >= 3 * n_words:
            break
    return " ".join(words)


def recombined_paragraph(m: Material, rng: random.Random) -> str:
    return " ".join(rng.choice(m.sentences) for _ in range(rng.randint(2, 8)))


def list_paragraph(m: Material, rng: random.Random) -> str:
    bullet = rng.choice(["- ", "* ", "1. ", "• "])
    items = [rng.choice(m.sentences) for _ in range(rng.randint(2, 6))]
    if bullet == "1. ":
        return "\n".join(f"{i}. {s}" for i, s in enumerate(items, 1))
    return "\n".join(bullet + s for s in items)


def title(m: Material, rng: random.Random) -> str:
    words = markov_paragraph(m, rng, 3).split()[: rng.randint(2, 8)]
    text = " ".join(words).rstrip(".,;:!?")
    return rng.choice(["", "", "# ", "## "]) + text[:1].upper() + text[1:]


_TYPOGRAPHY = [(" -- ", " — "), (" - ", " – "), ("...", "…"), ("(c)", "©"), (" 'n' ", " ’n’ ")]
_EMOJI = ["🙂", "🚀", "✅", "⚠️", "📦", "🔧", "👍", "🎉", "❤️", "🐍"]


def decorate(text: str, rng: random.Random) -> str:
    """Typographic unicode as editors and web pages produce it: curly quotes, dashes, an emoji now and then."""
    for a, b in _TYPOGRAPHY:
        text = text.replace(a, b)
    text = re.sub(r'"([^"\n]{1,80})"', "“\\1”", text)
    text = re.sub(r"(\w)'(\w)", "\\1’\\2", text)
    if rng.random() < 0.3:
        pos = text.rfind(". ", 0, max(1, len(text) // 2))
        if pos > 0:
            text = text[: pos + 1] + " " + rng.choice(_EMOJI) + text[pos + 1 :]
    return text


def prose_document(m: Material, rng: random.Random, target: int, foreign_heavy: bool) -> str:
    parts = [title(m, rng)] if rng.random() < 0.35 else []
    size = 0
    while size < target:
        r = rng.random()
        if foreign_heavy and r < 0.7 or r < 0.03:
            p = "\n".join(rng.choice(m.foreign) for _ in range(rng.randint(1, 4)))
        elif r < 0.33:
            p = m.paragraph(rng)
        elif r < 0.63:
            p = recombined_paragraph(m, rng)
        elif r < 0.93:
            p = markov_paragraph(m, rng, rng.randint(15, 160))
        elif r < 0.97:
            p = list_paragraph(m, rng)
        else:
            p = "```python\n" + code_window(m, rng, rng.randint(200, 1500)) + "\n```"
        parts.append(p)
        size += len(p.encode("utf-8")) + 2
    text = "\n\n".join(parts)
    return decorate(text, rng) if rng.random() < 0.2 else text


# ---------------------------------------------------------------------------------------------------------------
# code

_file_cache: OrderedDict[Path, str] = OrderedDict()


def _cached_read(path: Path) -> str:
    text = _file_cache.get(path)
    if text is None:
        text = _read_text(path)
        _file_cache[path] = text
        if len(_file_cache) > 512:
            _file_cache.popitem(last=False)
    else:
        _file_cache.move_to_end(path)
    return text


def code_window(m: Material, rng: random.Random, target: int) -> str:
    """`target` characters of one source file from a random line, or several small files concatenated."""
    files = m.c_files if m.c_files and rng.random() < 0.25 else m.code_files
    chunks, size = [], 0
    while size < target:
        path = rng.choice(files)
        text = _cached_read(path)
        if not text.strip():
            continue
        if len(text) > target - size:
            start = text.rfind("\n", 0, rng.randrange(len(text) - (target - size) + 1)) + 1
            end = text.find("\n", start + target - size)
            text = text[start : end if end > 0 else len(text)]
        if chunks:  # a dump of several files, as code corpora (e.g. repository concatenations) have
            comment = "//" if path.suffix in (".h", ".c", ".cpp", ".hpp", ".cc") else "#"
            text = f"{comment} ---- {path.name} ----\n{text}"
        chunks.append(text)
        size += len(text)
    return "\n\n".join(chunks)


# ---------------------------------------------------------------------------------------------------------------
# documents and the file


def doc_size(spec: CorpusSpec, rng: random.Random) -> int:
    size = rng.lognormvariate(0.0, spec.sigma) * spec.median_doc_bytes
    return int(min(max(size, spec.min_doc_bytes), spec.max_doc_bytes))


def document(spec: CorpusSpec, m: Material, rng: random.Random) -> str:
    target = doc_size(spec, rng)
    if rng.random() < spec.code_fraction:
        text = code_window(m, rng, target)
    else:
        text = prose_document(m, rng, target, foreign_heavy=rng.random() < 0.03)
    if rng.random() < 0.002:  # text that looks like a special token is ordinary text to the tokenizer
        cut = rng.randrange(len(text) + 1)
        text = text[:cut] + rng.choice(["<|endoftext|>", "<|im_start|>", "<s>", "[CLS]"]) + text[cut:]
    text = text[: spec.max_doc_bytes]  # characters, so a multi-byte tail may pass max slightly
    if len(text.encode("utf-8")) < spec.min_doc_bytes:
        text += "\n\n" + recombined_paragraph(m, rng)
    return text


def write_corpus(spec: CorpusSpec, path: Path, log=print) -> dict:
    """Generate the corpus into `path` atomically; returns its statistics (also written to `path`.meta.json)."""
    t0 = time.perf_counter()
    rng = random.Random(spec.seed)
    material = gather_material(random.Random(spec.seed + 1))
    log(f"material: {material.fingerprint()} ({time.perf_counter() - t0:.1f} s)")
    target = int(spec.size_mb * MB)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    docs = text_bytes = file_bytes = 0
    with open(tmp, "wb") as f:
        while file_bytes < target:
            text = document(spec, material, rng)
            line = orjson.dumps({"text": text, "id": f"s{spec.seed}-{docs:09d}"}) + b"\n"
            f.write(line)
            docs += 1
            text_bytes += len(text.encode("utf-8"))
            file_bytes += len(line)
        f.flush()
        os.fsync(f.fileno())
    stats = {
        "spec": asdict(spec),
        "documents": docs,
        "text_bytes": text_bytes,
        "file_bytes": file_bytes,
        "material": material.fingerprint(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _write_json_atomic(_meta_path(path), stats)
    os.replace(tmp, path)
    return stats


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta.json")


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def ensure_corpus(spec: CorpusSpec, path: Path | None = None, log=print) -> tuple[Path, dict]:
    """The corpus for `spec` at `path`, generated only when it is missing or was made with other parameters."""
    path = Path(path) if path else default_path(spec)
    meta = _meta_path(path)
    if path.is_file() and meta.is_file():
        stats = json.loads(meta.read_text())
        if stats.get("spec") == asdict(spec) and stats.get("file_bytes") == path.stat().st_size:
            log(f"reusing {path} ({stats['documents']} documents, {stats['file_bytes'] / MB:.1f} MB)")
            return path, stats
    log(f"generating {path} ({spec.size_mb:g} MB, seed {spec.seed}) ...")
    stats = write_corpus(spec, path, log)
    log(f"wrote {path}: {stats['documents']} documents, {stats['file_bytes'] / MB:.1f} MB in {stats['seconds']} s")
    return path, stats


def repeated_corpus(spec: CorpusSpec, copies: int, log=print) -> tuple[Path, dict]:
    """`copies` back-to-back copies of the corpus for `spec`, for inputs past what is worth generating (10 GB takes
    an hour to generate here, a minute to copy): the same documents again, which is what a memory check needs.

    Example: repeated_corpus(CorpusSpec(1000), 10) -> benchmarks/work/corpus-1000mb-s1234-x10.jsonl (10 GB)
    """
    base, stats = ensure_corpus(spec, log=log)
    path = base.with_name(f"{base.stem}-x{copies}.jsonl")
    want = {**stats, "copies": copies, "documents": stats["documents"] * copies}
    want.update(text_bytes=stats["text_bytes"] * copies, file_bytes=stats["file_bytes"] * copies)
    meta = _meta_path(path)
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()) == want:
        log(f"reusing {path} ({want['file_bytes'] / MB:.0f} MB)")
        return path, want
    log(f"writing {path}: {copies} copies of {base} ...")
    tmp = path.with_name(path.name + ".tmp")
    with open(base, "rb") as src, open(tmp, "wb") as dst:
        for _ in range(copies):
            offset, size = 0, stats["file_bytes"]
            while offset < size:  # in-kernel copy, no pass through Python's buffers
                copied = os.copy_file_range(src.fileno(), dst.fileno(), size - offset, offset)
                if copied == 0:
                    raise OSError(f"{base} shrank while being copied")
                offset += copied
        os.fsync(dst.fileno())
    _write_json_atomic(meta, want)
    os.replace(tmp, path)
    return path, want


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, required=True, help="size of the JSONL file in MB (10^6 bytes)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--output", type=Path, help="default: benchmarks/work/corpus-<size>mb-s<seed>.jsonl")
    args = ap.parse_args(argv)
    ensure_corpus(CorpusSpec(size_mb=args.size_mb, seed=args.seed), args.output)


if __name__ == "__main__":
    main()
