"""export-hf: a trained run of either family, exported with its tokenizer, is a transformers model that gives the
trainer's logits, stops generating at the tokenizer's end-of-document id, and tokenizes as corpusforge does; a bad
input leaves nothing, and a kill -9 at any point leaves no partial export under the output's name."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import trainkit
from click.testing import CliRunner

from corpusforge.cli import main
from corpusforge.preprocess import PreprocessConfig, preprocess
from corpusforge.tokenizers import load_tokenizer
from corpusforge.tokenizers.training import train_tokenizer
from corpusforge.train import checkpoint as ckpt
from corpusforge.train import load_config, train
from corpusforge.train.trainer import build_model, model_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below loads from local directories

FAMILIES = {
    "gpt2": ['model.family="gpt2"', "model.bias=false"],  # no biases: the export writes GPT-2's as zeros
    "llama": ['model.family="llama"', "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden=64"],
}
WORDS = "the quick brown fox jumps over lazy dog héllo wörld naïve 你好 世界 data model token 42 1234567".split()
# what a user tries first: non-ASCII, whitespace runs, the end-of-document token's text inside a text
TEXTS = ["Hello world", "héllo wörld, naïve café 你好 🙂", "a   b\t\t c\n\n\n  d  ", "x<|endoftext|>y <|endoftext|>",
         "1234567 3.14159", ""]  # fmt: skip
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "export.json"}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # if the hub was imported before


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Token ids below 64, written without a tokenizer (no P.preprocess.json)."""
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> str:
    """Text preprocessed with the default tokenizer, cl100k_base, which P.preprocess.json records."""
    root = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(60))}) for _ in range(150)]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    preprocess(PreprocessConfig(inputs=(str(root / "c.jsonl"),), output_prefix=str(root / "c"), workers=1))
    return str(root / "c_text_document")


def _train(data: str, out_dir: Path, family: str, vocab_size: int):
    args = trainkit.tiny_overrides(data, out_dir, n_layer=2, max_steps=3, eval_interval=0)
    cfg = load_config(None, [*args, *FAMILIES[family], f"model.vocab_size={vocab_size}"])
    train(cfg, log=lambda line: None)
    return cfg


@pytest.fixture(scope="module")
def cl100k_runs(text_corpus, tmp_path_factory):
    """family -> (config, run dir) of a tiny run on cl100k_base tokens, trained on first use."""
    runs = {}

    def get(family: str):
        if family not in runs:
            out = tmp_path_factory.mktemp(f"run-{family}")
            runs[family] = (_train(text_corpus, out, family, 100277), out)
        return runs[family]

    return get


@pytest.fixture(scope="module")
def small_run(corpus, tmp_path_factory) -> Path:
    """A GPT-2 run of 400 ids on data with no recorded tokenizer: room for the tokenizers trained below."""
    out = tmp_path_factory.mktemp("run-small")
    _train(corpus, out, "gpt2", 400)
    return out


@pytest.fixture(scope="module")
def small_tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(30)) + "\n\n" for _ in range(300)]
    train_tokenizer(texts, 400, root / "tokenizer.json")
    train_tokenizer(texts, 300, root / "tok.model", kind="sentencepiece")
    return {"tokenizer.json": root / "tokenizer.json", "sentencepiece": root / "tok.model"}


def export(*args: str):
    return CliRunner().invoke(main, ["export-hf", *map(str, args)])


def check_transformers_model(hf: Path, run_dir: Path, cfg, tokenizer, eod: int) -> None:
    """The export loads offline with AutoModelForCausalLM and AutoTokenizer, tokenizes as `tokenizer` does both
    ways, carries `eod` as its bos/eos ids, gives the trainer's logits and stops generating at `eod`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(hf)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == tokenizer.encode_batch([text])[0].tolist(), text
        assert tok.decode(ids) == text
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    assert type(model).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[cfg.family]
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id == eod
    assert model.config.bos_token_id == tok.bos_token_id == eod

    ours = build_model(model_config(cfg))
    ckpt.load_model(ckpt.latest_checkpoint(run_dir), ours)
    x = torch.tensor([tok(" ".join(TEXTS))["input_ids"][: cfg.model.seq_length]])
    with torch.no_grad():
        expected, got = ours.eval()(x), model(x).logits
    assert expected.abs().max() > 0.1  # trained weights, not zeros
    assert torch.allclose(expected, got, atol=1e-5, rtol=1e-5)

    prompt = x[:, :8]

    class EodAt(LogitsProcessor):  # the model emits `eod` as its 3rd new token: generate must stop there
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == prompt.shape[1] + 2:
                scores[:] = -float("inf")
                scores[:, eod] = 0.0
            return scores

    out = model.generate(prompt, max_new_tokens=10, do_sample=False, logits_processor=LogitsProcessorList([EodAt()]))
    assert out.shape[1] == prompt.shape[1] + 3 and out[0, -1] == eod


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_is_a_transformers_model_with_the_runs_tokenizer(cl100k_runs, tmp_path, family):
    cfg, run_dir = cl100k_runs(family)
    result = export(run_dir, "--output", tmp_path / "hf", "--json")  # no --tokenizer: the run's, as recorded
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["tokenizer"] == "cl100k_base" and summary["eos_token_id"] == 100257
    assert {p.name for p in (tmp_path / "hf").iterdir()} == MODEL_FILES | TOKENIZER_FILES
    record = json.loads((tmp_path / "hf" / "export.json").read_text())
    assert record["tokenizer"] == "cl100k_base" and record["eos_token_id"] == 100257
    check_transformers_model(tmp_path / "hf", run_dir, cfg, load_tokenizer("cl100k_base"), 100257)


@pytest.mark.slow
def test_the_default_tokenizer_by_name_and_an_existing_output(cl100k_runs, tmp_path):
    _, run_dir = cl100k_runs("gpt2")
    out = tmp_path / "hf"
    assert export(run_dir, "--output", out).exit_code == 0
    first = {p.name: p.stat().st_ino for p in out.iterdir()}
    refused = export(run_dir, "--output", out, "--tokenizer", "cl100k_base")
    assert refused.exit_code == 1 and refused.output.startswith("corpusforge: error: ")
    assert "exists and is not empty" in refused.output and "--overwrite" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    assert {p.name: p.stat().st_ino for p in out.iterdir()} == first  # untouched

    result = export(run_dir, "--output", out, "--tokenizer", "cl100k_base", "--overwrite", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["replaced"] is True and json.loads(result.output)["eos_token_id"] == 100257
    assert {p.name for p in out.iterdir()} == MODEL_FILES | TOKENIZER_FILES
    assert {p.name: p.stat().st_ino for p in out.iterdir()} != first  # new files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the old one deleted, no temporary left


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tokenizer.json", "sentencepiece"])
def test_a_tokenizer_file_ships_with_its_own_eod(small_run, small_tokenizers, tmp_path, kind):
    source = small_tokenizers[kind]
    result = export(small_run, "--output", tmp_path / "hf", "--tokenizer", source, "--json")
    assert result.exit_code == 0, result.output
    tokenizer = load_tokenizer(source, engine="reference")
    assert json.loads(result.output)["eos_token_id"] == tokenizer.eod_id is not None
    if kind == "tokenizer.json":  # copied byte for byte
        assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == source.read_bytes()
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == tokenizer.encode_batch([text])[0].tolist(), text
        assert tok.decode(ids) == tokenizer.decode(ids)
    assert AutoConfig.from_pretrained(tmp_path / "hf").eos_token_id == tok.eos_token_id == tokenizer.eod_id


def test_gpt2_ships_with_its_eod_50256():
    from corpusforge.tokenizers import TokenizerError
    from corpusforge.tokenizers.hf_fast import hf_fast_tokenizer

    try:
        files = hf_fast_tokenizer("gpt2")  # r50k_base's ranks: in tiktoken's cache or nowhere, offline
    except TokenizerError as e:
        pytest.skip(f"gpt2's ranks are not available offline here: {e}")
    assert files.eos_id == files.bos_id == 50256


def test_overwrite_without_an_exchange_is_two_renames(small_run, tmp_path, monkeypatch):
    import errno

    from corpusforge.train import export_hf

    assert export(small_run, "--output", tmp_path / "hf").exit_code == 0
    (tmp_path / "hf" / "config.json").write_text("{}")  # marks the old export

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "Invalid argument")  # a file system without RENAME_EXCHANGE

    monkeypatch.setattr(export_hf, "_exchange", no_exchange)
    result = export(small_run, "--output", tmp_path / "hf", "--overwrite", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["replaced"] is True
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_without_a_recorded_tokenizer_no_ids_are_made_up(small_run, tmp_path):
    result = export(small_run, "--output", tmp_path / "hf", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["tokenizer"].startswith("none (no P.preprocess.json records the tokenizer of")
    assert summary["eos_token_id"] is None
    assert {p.name for p in (tmp_path / "hf").iterdir()} == MODEL_FILES
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] is None and config["bos_token_id"] is None  # not GPT-2's 50256


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if the export reads the checkpoint's weights: every check comes before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the export read the weights before refusing")

    monkeypatch.setattr(ckpt, "load_model", refuse)


@pytest.mark.parametrize(
    "tokenizer, message",
    [
        ("no-such-tokenizer", "unknown tokenizer 'no-such-tokenizer'"),
        ("{bad}", "is not a Hugging Face tokenizer.json"),
        ("cl100k_base", "has 100277 ids, more than the model's vocabulary (400)"),
    ],
    ids=["unknown-name", "not-a-tokenizer", "vocabulary-too-large"],
)
def test_a_bad_tokenizer_leaves_nothing(small_run, tmp_path, no_weights_read, tokenizer, message):
    if tokenizer == "{bad}":
        tokenizer = tmp_path / "bad.json"
        tokenizer.write_text("{}")
    before = sorted(tmp_path.iterdir())
    result = export(small_run, "--output", tmp_path / "out" / "hf", "--tokenizer", tokenizer)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("corpusforge: error: ") and len(result.output.strip().splitlines()) == 1
    assert message in result.output
    assert sorted(tmp_path.iterdir()) == before  # not even the output's parent


@pytest.mark.slow
def test_another_tokenizer_than_the_runs_is_refused(cl100k_runs, small_tokenizers, tmp_path, no_weights_read):
    _, run_dir = cl100k_runs("gpt2")
    result = export(run_dir, "--output", tmp_path / "hf", "--tokenizer", small_tokenizers["tokenizer.json"])
    assert result.exit_code == 1 and "not the tokenizer the run's data was written with (cl100k_base" in result.output
    assert not (tmp_path / "hf").exists()


def test_overwrite_replaces_earlier_exports_only(small_run, tmp_path, no_weights_read):
    (tmp_path / "mine.txt").write_text("not an export")
    result = export(small_run, "--output", tmp_path, "--overwrite")
    assert result.exit_code == 1 and "holds no config.json, so it is no earlier export" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
    (small_run / "config.json").write_text("{}")  # even where it looks like one, the run itself is never deleted
    result = export(small_run, "--output", small_run, "--overwrite")
    (small_run / "config.json").unlink()
    assert result.exit_code == 1 and "which --overwrite would delete" in result.output
    assert ckpt.latest_checkpoint(small_run) is not None


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["export-hf", str(tmp_path), "--output", str(tmp_path / "hf")])
    assert result.exit_code == 1 and "no complete checkpoint" in result.output


# ---------------------------------------------------------------------------------------------------------------
# kill -9 at every write: the export runs in a child process whose file writers SIGKILL it at the N-th call

KILLER = textwrap.dedent(
    """
    import contextlib, json, os, shutil, signal, sys
    from pathlib import Path

    import corpusforge.fsutil as fsutil
    import corpusforge.train.export_hf as export_hf
    from corpusforge.cli import main

    work, args, old = Path(sys.argv[1]), sys.argv[2:], None


    def run(n, out):
        '''Export to `out` in a child killed at its n-th event (0: never); the child's event count, or None.'''
        pid = os.fork()
        if pid == 0:
            count = [0]

            def tick():
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), signal.SIGKILL)

            def around(fn):  # an event before and after each call
                def hooked(*a, **k):
                    tick()
                    result = fn(*a, **k)
                    tick()
                    return result
                return hooked

            real_atomic_path = fsutil.atomic_path

            @contextlib.contextmanager
            def atomic_path(*a, **k):  # every file written: before it is opened, after its rename
                tick()
                with real_atomic_path(*a, **k) as tmp:
                    yield tmp
                tick()

            fsutil.atomic_path = atomic_path
            os.rename = around(os.rename)  # the export's directory rename (and the fallback's)
            export_hf._exchange = around(export_hf._exchange)  # --overwrite's swap
            try:
                main([*args, "--output", str(out)], standalone_mode=False)
            except BaseException:
                import traceback
                traceback.print_exc()
                os._exit(99)
            (out.parent / "events").write_text(str(count[0]))
            os._exit(0)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return code


    # once here, unhooked: every import and first-call cost paid before the forks (0.2 s per export after)
    main([*args, "--output", str(work / "warm" / "hf")], standalone_mode=False)
    if os.environ.get("KILL_OLD"):
        shutil.copytree(os.environ["KILL_OLD"], work / "count" / "hf")
    assert run(0, work / "count" / "hf") == 0
    events = int((work / "count" / "events").read_text())
    for n in range(1, events + 1):
        if os.environ.get("KILL_OLD"):  # an earlier export there: --overwrite must keep it or the new one whole
            shutil.copytree(os.environ["KILL_OLD"], work / f"kill-{n}" / "hf")
        code = run(n, work / f"kill-{n}" / "hf")
        assert code == -9, (n, code)
    print(events)
    """
)


def snapshot(directory: Path) -> dict[str, bytes] | None:
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.exists() else None


def run_killer(work: Path, args: list[str], old: Path | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_OLD": str(old) if old else ""}
    done = subprocess.run([sys.executable, "-c", KILLER, str(work), *args], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return int(done.stdout.split()[-1])


@pytest.mark.slow
def test_a_kill_at_every_write_leaves_the_output_absent_or_complete(small_run, small_tokenizers, tmp_path):
    args = ["export-hf", str(small_run), "--tokenizer", str(small_tokenizers["tokenizer.json"])]
    events = run_killer(tmp_path, args)
    complete = snapshot(tmp_path / "count" / "hf")
    assert set(complete) == MODEL_FILES | TOKENIZER_FILES
    # 7 files, each an event before and after, and the directory's rename
    assert events == 2 * len(complete) + 2
    for n in range(1, events + 1):
        seen = snapshot(tmp_path / f"kill-{n}" / "hf")
        assert seen is None or seen == complete, n
        assert (seen is None) == (n <= events - 1), n  # absent until the rename has happened
    # A rerun clears what the killed ones left (their temporary directories) and exports whole.
    work = tmp_path / "kill-1"
    assert [p.name for p in work.iterdir()] != []
    result = export(small_run, "--output", work / "hf", "--tokenizer", small_tokenizers["tokenizer.json"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in work.iterdir()) == ["hf"] and snapshot(work / "hf") == complete
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(work / "hf")
    AutoTokenizer.from_pretrained(work / "hf")


@pytest.mark.slow
def test_a_kill_during_overwrite_leaves_the_old_export_or_the_new_one(small_run, small_tokenizers, tmp_path):
    old = tmp_path / "old"
    assert export(small_run, "--output", old).exit_code == 0  # an export without a tokenizer
    previous = snapshot(old)
    args = ["export-hf", str(small_run), "--tokenizer", str(small_tokenizers["tokenizer.json"]), "--overwrite"]
    events = run_killer(tmp_path, args, old)
    complete = snapshot(tmp_path / "count" / "hf")
    assert set(complete) == MODEL_FILES | TOKENIZER_FILES
    for n in range(1, events + 1):
        seen = snapshot(tmp_path / f"kill-{n}" / "hf")
        assert seen in (previous, complete), n  # never absent: the two are exchanged in one step
