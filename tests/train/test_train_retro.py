"""`corpusforge train` on a RETRO model: a database built by the real build-knn, the CLI end to end, exact resume
(with and without loader workers), 2-rank gloo DDP, and every way a database can disagree with the config refused
in one line before training."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trainkit

from corpusforge.errors import CorpusforgeError
from corpusforge.retro import BuildConfig
from corpusforge.retro import build_knn as build
from corpusforge.train import load_config, train
from corpusforge.train.checkpoint import latest_checkpoint, load_meta
from corpusforge.train.config import new_key
from corpusforge.train.metrics import read_metrics
from corpusforge.train.retro_model import flops_per_token
from corpusforge.train.trainer import retro_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "retro"))
from retrokit import run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "retro-tiny-cpu.toml"
M = 16  # chunk length of the test databases: samples of 32 tokens are 2 chunks, neighbours 2 x 32 tokens


def build_knn(prefix: str, out: Path, *extra: str) -> Path:
    """`corpusforge build-knn` in its own process (the module's database)."""
    done = run_cli("build-knn", prefix, "--output", str(out), "--chunk-length", str(M), "--shard-size", "512",
                   "--recall-queries", "50", *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def build_knn_here(prefix: str, out: Path, **options) -> Path:
    """The same build in this process (the bad-input cases' small databases: no interpreter start-up)."""
    config = BuildConfig(prefix=prefix, output=str(out), chunk_length=M, shard_size=512, recall_queries=50, **options)
    build(config)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


@pytest.fixture(scope="module")
def db(corpus, tmp_path_factory) -> Path:
    return build_knn(corpus, tmp_path_factory.mktemp("db") / "db")


def overrides(db: Path, out_dir: Path, **extra) -> list[str]:
    """The trainer tests' tiny run, as a RETRO model of 2 layers (chunked cross-attention in the second)."""
    values = {"data_path": '""', "model": '"retro"', "n_layer": 2, "global_batch_tokens": 256, "max_steps": 6,
              "eval_interval": 3, "checkpoint_interval": 3,
              "retro.db": f'"{db}"', "retro.chunk_length": M, "retro.cca_layers": "[1]", **extra}  # fmt: skip
    base = [o for o in trainkit.tiny_overrides("", out_dir) if not o.startswith("data.path")]
    return base + [f"{new_key(k)}={v}" for k, v in values.items()]  # the tests' flat names, written as sections


def run(db: Path, out_dir: Path, **extra) -> dict:
    return train(load_config(CONFIG, overrides(db, out_dir, **extra)), log=lambda line: None)


def series(out_dir: Path, kind: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(out_dir / "metrics.jsonl", kind)}


@pytest.mark.slow
def test_cli_trains_on_the_database_and_reports_the_retrieval_gap(corpus, db, tmp_path):
    out = tmp_path / "run"
    args = [*overrides(db, out, max_steps=12, eval_interval=6, global_batch_tokens=512), f'data.path="{corpus}"']
    done = subprocess.run([sys.executable, "-m", "corpusforge.train", "--config", str(CONFIG), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "val_loss_random" in done.stdout and "retrieval_gain" in done.stdout
    plan = read_metrics(out / "metrics.jsonl", "plan")[0]
    cfg = load_config(CONFIG, args)
    assert plan["shape"]["family"] == "retro" and plan["shape"]["cca_layers"] == [1]
    assert plan["flops_per_token"] == flops_per_token(retro_config(cfg), 32)  # the encoder and CCA counted
    losses = series(out, "train", "loss")
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1] - 0.5
    valid = read_metrics(out / "metrics.jsonl", "valid")
    assert [v["step"] for v in valid] == [6, 12]
    for v in valid:
        assert v["retrieval_gain"] == pytest.approx(v["val_loss_random"] - v["val_loss"])
    summary = read_metrics(out / "metrics.jsonl", "summary")[0]
    assert summary["final_val_loss_random"] == valid[-1]["val_loss_random"]
    assert summary["data_wait_ms_p99_max"] >= summary["data_wait_ms_p50_max"] > 0
    assert load_meta(latest_checkpoint(out))["model_shape"]["family"] == "retro"


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_resume_gives_the_same_losses_step_for_step(db, tmp_path, workers):
    """Stopped at step 3 and resumed, with loader workers (raw batches assembled by RetroDataset) or without."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(db, whole, num_workers=workers, dropout=0.1)
    first = run(db, split, num_workers=workers, dropout=0.1, stop_at_step=3)
    assert first["last_step"] == 3
    second = run(db, split, num_workers=workers, dropout=0.1)
    assert (second["first_step"], second["last_step"]) == (4, 6)
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("valid", "val_loss"), ("valid", "val_loss_random")):
        a, b = series(whole, kind, key), series(split, kind, key)
        assert all(a[s] == b[s] for s in a), (kind, key)  # exactly equal floats
    assert sorted(series(split, "train", "loss")) == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["parallel.dp_shard=-1", "parallel.dp_replicate=1"]], ids=["ddp", "fsdp2"])
def test_two_rank_gloo_data_parallel_matches_one_rank(db, tmp_path, layout):
    """2 ranks x 8 samples against 1 rank x 2 micro-batches of 8: the same samples, the same averaged gradient;
    under FSDP2 the retrieval encoder is a sharded unit of its own, called from inside the first RETRO layer."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={trainkit.free_port()}", "-m", "corpusforge.train", "--config", str(CONFIG),
           *overrides(db, tmp_path / "ddp", global_batch_tokens=512), *layout]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run(db, tmp_path / "one", global_batch_tokens=512)
    a, b = series(tmp_path / "ddp", "train", "loss"), series(tmp_path / "one", "train", "loss")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=2e-3)
    summary = read_metrics(tmp_path / "ddp" / "metrics.jsonl", "summary")[0]
    assert summary["ranks"] == 2 and "retrieval_gain" in summary


def _other_data(corpus: str, db: Path, tmp_path: Path) -> dict:
    other = trainkit.write_markov_corpus(tmp_path / "other_text_document", seed=7)
    return {"data_path": f'"{other}"'}


def _more_neighbours(corpus: str, db: Path, tmp_path: Path) -> dict:
    return {"retro.num_neighbours": 3}


def _other_chunk_length(corpus: str, db: Path, tmp_path: Path) -> dict:
    return {"retro.chunk_length": 32, "seq_length": 64, "global_batch_tokens": 512}


def _data_changed_since_build(corpus: str, db: Path, tmp_path: Path) -> dict:
    """The database's corpus re-written (another tokenisation, say) after the build: same path, other tokens."""
    copy = tmp_path / "db"
    shutil.copytree(db, copy)
    prefix = str(tmp_path / "markov_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus + suffix, prefix + suffix)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["config"]["prefix"] = manifest["identity"]["data"]["prefix"] = prefix
    (copy / "manifest.json").write_text(json.dumps(manifest))
    trainkit.write_markov_corpus(prefix, seed=3)
    return {"retro.db": f'"{copy}"'}


def _neighbours_of_other_chunks(corpus: str, db: Path, tmp_path: Path) -> dict:
    """A neighbours file made for another dataset (another number of query chunks)."""
    other = trainkit.write_markov_corpus(tmp_path / "small_text_document", num_docs=20, seed=5)
    small = build_knn_here(other, tmp_path / "small-db")
    return {"retro.neighbours_path": f'"{small / "neighbours.bin"}"'}


def _other_tokenizer(corpus: str, db: Path, tmp_path: Path) -> dict:
    """A database of corpus A built for training data B (--query-prefix), A and B tokenised differently."""
    a = trainkit.write_markov_corpus(tmp_path / "a_text_document", num_docs=40, seed=1)
    b = trainkit.write_markov_corpus(tmp_path / "b_text_document", num_docs=40, seed=2)
    for name, tok in (("a", "gpt2"), ("b", "cl100k_base")):
        record = {"config": {"tokenizer": tok}, "stats": {"tokenizer": tok}, "fingerprint": {"tokenizer": tok + "-fp"}}
        (tmp_path / f"{name}.preprocess.json").write_text(json.dumps(record))
    built = build_knn_here(a, tmp_path / "ab-db", query_prefix=b)
    return {"retro.db": f'"{built}"'}


def _damage_neighbours(db: Path, tmp_path: Path, row: int, value: int) -> dict:
    """A copy of the database whose neighbours file has `value` written over row `row`'s first id, in place: the
    header and the size stay right."""
    copy = tmp_path / "db"
    shutil.copytree(db, copy)
    with open(copy / "neighbours.bin", "r+b") as f:
        _, _, n, k = struct.unpack_from("<8sQQQ", f.read(32))
        f.seek(64 + 8 * k * row)
        f.write(struct.pack("<q", value))
    return {"retro.db": f'"{copy}"'}


def _neighbour_id_past_the_chunks(corpus: str, db: Path, tmp_path: Path) -> dict:
    return _damage_neighbours(db, tmp_path, row=7, value=10**6)


def _negative_neighbour_id(corpus: str, db: Path, tmp_path: Path) -> dict:
    return _damage_neighbours(db, tmp_path, row=7, value=-2)


BAD = [
    (_neighbour_id_past_the_chunks, "neighbours.bin: row 7 holds neighbour id 1000000 (column 0), but the database"),
    (_negative_neighbour_id, "neighbours.bin: row 7 holds neighbour id -2 (column 0), but the database"),
    (_other_data, "neighbours cover the chunks of"),
    (_more_neighbours, "holds 2 neighbours per chunk, 3 were asked for"),
    (_other_chunk_length, "built with chunk length 16, but 32 was asked for"),
    (_data_changed_since_build, "changed since the database was built"),
    (_neighbours_of_other_chunks, "rows for"),
    (_other_tokenizer, "tokenised with gpt2, the training data"),
]


@pytest.mark.parametrize("make, words", BAD, ids=[f.__name__.strip("_") for f, _ in BAD])
def test_a_database_that_does_not_fit_the_config_is_refused_in_one_line(corpus, db, tmp_path, make, words):
    extra = make(corpus, db, tmp_path)
    out = tmp_path / "run"
    with pytest.raises(CorpusforgeError) as e:
        run(db, out, **extra)
    message = str(e.value)
    assert words in message and "\n" not in message, message
    assert not (out / "checkpoints").exists()  # refused before the first step


@pytest.mark.parametrize(
    "parallel, words",
    [
        (["parallel.tp=2", "parallel.dp_replicate=1"], "data parallelism only"),
        (["parallel.pp=2", "parallel.dp_replicate=1"], "data parallelism only"),
        (['parallel.activation_checkpoint="full"'], "not supported for RETRO"),
        (['parallel.activation_checkpoint="selective"'], "not supported for RETRO"),
    ],
)
def test_layouts_retro_does_not_run_are_refused_in_one_line(db, tmp_path, parallel, words):
    cfg = load_config(CONFIG, [*overrides(db, tmp_path), *parallel])
    with pytest.raises(CorpusforgeError, match=words) as e:
        train(cfg, dry_run=True, world_size=2, log=lambda line: None)
    assert "\n" not in str(e.value)


def test_dry_run_memory_counts_the_encoder_and_the_cca(db, tmp_path):
    """The --dry-run estimate of a RETRO run holds its encoder's activations over the K*R/m neighbour tokens of each
    decoder token and its CCA layers' (trainer.retro_activation_bytes): more than the same decoder as a GPT, and
    growing with K at a fixed decoder."""
    from corpusforge.train import parallel as par
    from corpusforge.train.trainer import gpt_config, memory_estimate, retro_activation_bytes

    def estimate(k: int) -> tuple[dict, dict, float]:
        cfg = load_config(CONFIG, overrides(db, tmp_path, **{"retro.num_neighbours": k}))
        g = retro_config(cfg)
        layout = par.resolve_layout(cfg, 1, g)
        retro = memory_estimate(g, 1000, cfg, layout, torch.float32)
        gpt = memory_estimate(gpt_config(cfg), 1000, cfg, layout, torch.float32)
        return retro, gpt, retro_activation_bytes(g, cfg.model.seq_length, cfg.schedule.micro_batch_size, False)

    retro, gpt, extra = estimate(2)
    assert extra > 0 and retro["activations_gb"] == pytest.approx(gpt["activations_gb"] + extra / 1e9)
    assert estimate(1)[2] < extra
    summary = train(load_config(CONFIG, overrides(db, tmp_path)), dry_run=True, log=lambda line: None)
    assert summary["memory_estimate"]["activations_gb"] == round(retro["activations_gb"], 3)


@pytest.mark.slow
def test_compile_true_trains_as_eager_on_cpu(db, tmp_path):
    """compile = true with a RETRO model (torch.compile of the model in place, inductor on CPU): the same losses as
    eager to float32 rounding, step for step."""
    eager = tmp_path / "eager"
    compiled = tmp_path / "compiled"
    run(db, eager, max_steps=3, eval_interval=3)
    run(db, compiled, max_steps=3, eval_interval=3, compile="true")
    for kind, key in (("train", "loss"), ("valid", "val_loss"), ("valid", "val_loss_random")):
        a, b = series(eager, kind, key), series(compiled, kind, key)
        assert sorted(a) == sorted(b) and a
        assert all(b[s] == pytest.approx(a[s], rel=1e-4, abs=1e-4) for s in a), (kind, key, a, b)
