"""The parallel plan: every layout trains like one process (fp32, same seed, same data: the same losses and
gradient norms, step by step), a checkpoint moves between layouts, and every impossible layout is one line before
any process group starts.

The distributed runs go through `torchrun` (gloo on CPU) under a hard timeout: pipelining and DTensor on gloo have
no upstream CI, and a hang must fail the test rather than CI. Starting torchrun and importing torch in every process
costs more than a tiny run, so the runs that need the same number of processes share one launch (RUNS below,
tests/train/multirun.py), made once per module when a test first asks for it; each test checks its own run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trainkit

from corpusforge.train import load_config, train
from corpusforge.train.config import ConfigError
from corpusforge.train.parallel import balance_stages, resolve_layout
from corpusforge.train.trainer import model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAMILIES = {
    "gpt2": ['model.family="gpt2"'],
    "llama": ['model.family="llama"', "model.n_kv_head=2", "model.ffn_hidden=64"],  # GQA: 4 heads share 2 KV
}
TP2 = ["parallel.tp=2", "parallel.dp_replicate=1"]  # with sequence parallel and the parallel loss (the defaults)
FSDP2_TP2 = ["parallel.tp=2", "parallel.dp_shard=2", "parallel.dp_replicate=1"]
# 4 layers: a layer per stage for the schedules with 2 stages per rank
PP2 = ["model.n_layer=4", "parallel.pp=2", "parallel.dp_replicate=1"]
# Pipeline schedules: the two families share them out so that each schedule runs once and each family meets several.
SCHEDULES = [("gpt2", "1F1B"), ("gpt2", "Interleaved1F1B"), ("llama", "GPipe"), ("llama", "LoopedBFS"),
             ("llama", "InterleavedZeroBubble"), ("llama", "ZBVZeroBubble")]  # fmt: skip
# data.document_mask in every layout on 2 processes: samples of 64 tokens pack the corpus's 40-200-token documents;
# the boundaries reach every stage of a pipeline with each micro-batch (1F1B: one stage a rank; interleaved: two).
DOCUMENTS = ["data.document_mask=true", "model.n_layer=4", "model.seq_length=64", "schedule.micro_batch_size=4"]
DOCUMENT_LAYOUTS = {"tp2": ("llama", TP2), "ddp2": ("gpt2", ["parallel.dp_replicate=2"]),
                    "fsdp2": ("llama", ["parallel.dp_shard=2", "parallel.dp_replicate=1"]),
                    "pp2-1F1B": ("gpt2", [*PP2, 'parallel.pp_schedule="1F1B"']),
                    "pp2-Interleaved1F1B": ("llama", [*PP2, 'parallel.pp_schedule="Interleaved1F1B"'])}  # fmt: skip
# 4 data-parallel ranks x 4 x 32 tokens = the 512-token batch
RESHARD = ["model.n_layer=4", "schedule.micro_batch_size=4"]
SAVED = "save-tp2pp2/checkpoints/step_00000002"


def runs(nproc: int) -> dict[str, tuple[str, list[str]]]:
    """{run name: (family, overrides)} of the launch with `nproc` processes, in the order they run."""
    if nproc == 2:
        return {"tp2-gpt2": ("gpt2", TP2), "tp2-llama": ("llama", TP2),
                **{f"pp2-{s}": (f, [*PP2, f'parallel.pp_schedule="{s}"']) for f, s in SCHEDULES},
                **{f"documents-{name}": (f, [*DOCUMENTS, *extra])
                   for name, (f, extra) in DOCUMENT_LAYOUTS.items()}}  # fmt: skip
    if nproc == 4:  # the tp2 x pp2 save first: the dp4 run resumes from it
        return {"fsdp2xtp2-gpt2": ("gpt2", FSDP2_TP2), "fsdp2xtp2-llama": ("llama", FSDP2_TP2),
                "save-tp2pp2": ("gpt2", [*RESHARD, "parallel.pp=2", "parallel.tp=2", "parallel.dp_replicate=1",
                                         "schedule.stop_at_step=2"]),
                "resume-dp4": ("gpt2", [*RESHARD, "parallel.dp_replicate=-1", "checkpoint.resume=@SAVED"])}  # fmt: skip
    return {"pp2xfsdp2xtp2": ("llama", ["model.n_layer=4", "parallel.pp=2", *FSDP2_TP2])}  # 3D on 8 processes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def overrides(corpus: str, out, family: str, *extra: str) -> list[str]:
    base = trainkit.tiny_overrides(corpus, out, n_layer=2, n_head=4, max_steps=4, eval_interval=0,
                                   checkpoint_interval=0, async_checkpoint="false", resume='"never"')  # fmt: skip
    return [*base, *FAMILIES[family], *extra]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The one-process reference run of a family (and model overrides), made once per module."""
    made: dict[tuple, dict] = {}

    def get(family: str, *extra: str) -> dict[int, dict]:
        if (family, *extra) not in made:
            d = tmp_path_factory.mktemp(f"single-{family}")
            train(load_config(None, overrides(corpus, d, family, *extra)), log=lambda line: None)
            made[(family, *extra)] = trainkit.run_records(d)
        return made[(family, *extra)]

    return get


@pytest.fixture(scope="module")
def launch(corpus, tmp_path_factory):
    """launch(nproc) -> (stdout, {run name: out_dir}): the runs of `nproc` processes, made in one torchrun."""
    made: dict[int, tuple[str, dict[str, Path]]] = {}

    def get(nproc: int) -> tuple[str, dict[str, Path]]:
        if nproc not in made:
            work = tmp_path_factory.mktemp(f"torchrun{nproc}")
            dirs = {name: work / name for name in runs(nproc)}
            args = [[a.replace("@SAVED", f'"{work / SAVED}"') for a in overrides(corpus, dirs[name], family, *extra)]
                    for name, (family, extra) in runs(nproc).items()]  # fmt: skip
            made[nproc] = (trainkit.torchrun_runs(args, nproc, work, timeout=600).stdout, dirs)
        return made[nproc]

    return get


def assert_same_run(got: dict[int, dict], want: dict[int, dict], steps: tuple[int, ...] = (1, 2, 3, 4)) -> None:
    assert sorted(got) == sorted(steps) and set(steps) <= set(want)
    for key in ("loss", "grad_norm"):
        a, b = [got[s][key] for s in steps], [want[s][key] for s in steps]
        assert a == pytest.approx(b, rel=1e-5), (key, a, b)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout, nproc", [("tp2", 2), pytest.param("fsdp2xtp2", 4, marks=pytest.mark.slow)])
def test_layout_trains_like_one_process(launch, single, family, layout, nproc):
    """tp=2 with sequence parallel and the parallel loss; FSDP2 x tp=2."""
    stdout, dirs = launch(nproc)
    assert '"layout"' in stdout
    assert_same_run(trainkit.run_records(dirs[f"{layout}-{family}"]), single(family))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_changes_memory_not_results(corpus, single, tmp_path, mode):
    train(load_config(None, overrides(corpus, tmp_path, "llama", f'parallel.activation_checkpoint="{mode}"')),
          log=lambda line: None)  # fmt: skip
    assert_same_run(trainkit.run_records(tmp_path), single("llama"))


@pytest.mark.parametrize("family, schedule", SCHEDULES, ids=lambda v: v)
def test_pipeline_schedule_trains_like_one_process(launch, single, family, schedule):
    _, dirs = launch(2)
    assert_same_run(trainkit.run_records(dirs[f"pp2-{schedule}"]), single(family, "model.n_layer=4"))


@pytest.mark.parametrize("layout", sorted(DOCUMENT_LAYOUTS))
def test_document_masks_train_like_one_process(launch, single, layout):
    """data.document_mask under tp=2 (sequence parallel), DDP, FSDP2 and two pipeline schedules: the losses of one
    process with the same masks; and those differ from plain causal training, so the masks did reach the stages."""
    family, _ = DOCUMENT_LAYOUTS[layout]
    _, dirs = launch(2)
    want = single(family, *DOCUMENTS)
    assert_same_run(trainkit.run_records(dirs[f"documents-{layout}"]), want)
    causal = single(family, *DOCUMENTS[1:])
    assert all(want[s]["loss"] != causal[s]["loss"] for s in (1, 2, 3, 4))


@pytest.mark.slow
def test_pp2_fsdp2_tp2_on_8_processes(launch, single):
    """3D: 2 stages x 2 FSDP shards x 2 tensor halves, Llama (GQA), 8 gloo processes."""
    _, dirs = launch(8)
    assert_same_run(trainkit.run_records(dirs["pp2xfsdp2xtp2"]), single("llama", "model.n_layer=4"))


@pytest.mark.slow
def test_checkpoint_moves_between_layouts(launch, single, corpus, tmp_path):
    """Saved at tp=2 x pp=2 after step 2 (each rank writing its own shards), resumed at dp=4 and at one process:
    steps 3 and 4 are those of an uninterrupted run (GPT-2: the tied embedding crosses the pipeline and the tensor
    split both ways)."""
    _, dirs = launch(4)
    want = single("gpt2", *RESHARD)
    assert_same_run(trainkit.run_records(dirs["save-tp2pp2"]), want, steps=(1, 2))
    shards = sorted(p.name for p in (dirs["save-tp2pp2"] / "checkpoints" / "step_00000002").glob("*.distcp"))
    assert shards == [f"__{rank}_0.distcp" for rank in range(4)]  # every rank wrote its own
    assert_same_run(trainkit.run_records(dirs["resume-dp4"]), want, steps=(3, 4))
    args = overrides(corpus, tmp_path, "gpt2", *RESHARD, f'checkpoint.resume="{dirs["save-tp2pp2"].parent / SAVED}"')
    train(load_config(None, args), log=lambda line: None)
    assert_same_run(trainkit.run_records(tmp_path), want, steps=(3, 4))


# ---------------------------------------------------------------------------------------------------------------
# bad layouts: one line each, before any collective


def layout_of(*extra: str, world: int, family: str = "llama"):
    cfg = load_config(None, ["model.n_layer=4", "model.n_head=4", "model.n_embd=32", 'model.name="custom"',
                             "model.vocab_size=64", "model.seq_length=32", *FAMILIES[family], *extra])  # fmt: skip
    return resolve_layout(cfg, world, model_config(cfg))


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (["parallel.tp=2", "parallel.dp_replicate=1"], 4, r"dp_shard 1 x tp 2 = 2 but there are 4 rank\(s\)"),
        (["parallel.tp=3"], 8, r"8 rank\(s\) do not divide by .* = 3"),
        (["parallel.tp=4", "parallel.dp_replicate=1"], 4, "tp = 4 does not divide n_kv_head 2"),
        (["parallel.tp=8", "parallel.dp_replicate=1"], 8, "tp = 8 does not divide n_head 4"),
        (["parallel.pp=8", "parallel.dp_replicate=1"], 8, "a stage would hold no layer"),
        (["parallel.pp=2", 'parallel.pp_schedule="Interleaved1F1B"', "parallel.pp_layers=[2, 2]"], 2, "give 4 counts"),
        (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "does not divide micro_batch_size"),
        (["parallel.cpu_offload=true"], 2, "cpu_offload needs FSDP2"),
        (["parallel.tp=2", "model.seq_length=31"], 2, "does not divide seq_length 31"),
    ],
)
def test_bad_layouts_are_one_line(extra, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        layout_of(*extra, world=world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ('parallel.pp_schedule="1f1b"', "choose one of .*did you mean 1F1B"),
        ('parallel.pp_schedule="Chimera"', "pp_schedule = 'Chimera': choose one of"),
        ("parallel.dp_shard=-1", "dp_replicate and dp_shard are both -1"),
        ("parallel.tp=0", "parallel.tp = 0: give a degree"),
        ("parallel.tensor=2", "unknown key 'tensor'"),
        ('parallel.activation_checkpoint="some"', '"none", "selective" or "full"'),
    ],
)
def test_bad_parallel_keys(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_degrees_are_inferred_and_ranks_placed():
    layout = layout_of("parallel.tp=2", "parallel.pp=2", "parallel.dp_replicate=1", "parallel.dp_shard=-1", world=8)
    assert (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp) == (2, 1, 2, 2)
    assert layout.stage_layers == ((0, 1), (2, 3))
    # tp innermost: ranks 0 and 1 hold the two halves of each layer and read the same batch
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 1}


def test_stages_balance_parameters():
    assert balance_stages(8, 2, 10, 0, 0) == [4, 4]
    assert balance_stages(8, 2, 10, 0, 40) == [6, 2]  # a heavy head: fewer layers on the last stage
    assert balance_stages(5, 5, 10, 100, 100) == [1, 1, 1, 1, 1]  # at least one layer each


def test_a_wrong_layout_stops_before_the_process_group(corpus, tmp_path):
    """RANK/WORLD_SIZE set as torchrun would, but no rendezvous anywhere: a check after init_process_group would
    hang on it; the error comes first, as one line."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(trainkit.free_port())}  # fmt: skip
    cmd = [sys.executable, "-m", "corpusforge.train", *overrides(corpus, tmp_path, "llama", "parallel.tp=2")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(lines) == 1 and "3 rank(s) do not divide by" in lines[0] and "tp 2 = 2" in lines[0], done.stderr


def test_dry_run_shows_each_ranks_layers_shard_and_memory(tmp_path):
    """Llama 3.1 8B on 8 ranks (tp 2 x pp 2, FSDP over the 2 left), planned on the meta device in one process."""
    lines: list[str] = []
    cfg = load_config(
        CONFIGS / "llama3-8b.toml",
        ["parallel.tp=2", "parallel.pp=2", "schedule.max_steps=1", "schedule.global_batch_tokens=131072",
         'data.source="synthetic"', 'device="cpu"', 'dtype="bfloat16"', f'out_dir="{tmp_path}"'],
    )  # fmt: skip
    plan = train(cfg, dry_run=True, log=lines.append, world_size=8)
    assert plan["params"] == 8_030_261_248 and plan["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    ranks = plan["ranks"]
    assert [r["stages"] for r in ranks] == [[0]] * 4 + [[1]] * 4
    assert "layers 0-15 + embedding" in ranks[0]["holds"] and "layers 16-31 + norm+head" in ranks[7]["holds"]
    assert "FSDP shard 1/2" in ranks[3]["shard"] and "tp 1/2" in ranks[3]["shard"]
    # 4 B/param fp32 weights of a quarter of the model (each stage holds half, tp halves it), FSDP halves it again
    first, last = ranks[0]["memory_gb"], ranks[7]["memory_gb"]
    assert first["params_gb"] == pytest.approx(8.03 / 2 / 2 / 2 * 4, rel=0.02)
    assert first["optimizer_gb"] == pytest.approx(2 * first["params_gb"], rel=1e-3)
    assert first["logits_gb"] == 0 and last["logits_gb"] > 0  # the head and its logits live on the last stage
    assert sum(line.startswith("  rank ") for line in lines) == 8


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel_keeps_a_tied_head_tied(tmp_path, family):
    """parallelize_module gives the embedding and the head a DTensor each; apply_tp ties them again (a 1-rank
    group here: the re-tying is the same whatever tp is; the 2-rank runs above prove the training matches)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from corpusforge.train.parallel import apply_tp, tied_pair
    from corpusforge.train.trainer import build_model

    cfg = load_config(None, ['model.name="custom"', "model.n_layer=1", "model.n_head=4", "model.n_embd=32",
                             "model.vocab_size=64", "model.seq_length=32", *FAMILIES[family]])  # fmt: skip
    mcfg = model_config(cfg)
    if family == "llama":
        mcfg = type(mcfg)(**{**mcfg.__dict__, "tie_embeddings": True})  # as Llama 3.2 1B and 3B
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_model(mcfg)
        apply_tp(model, init_device_mesh("cpu", (1,)), sp=True, loss_parallel=True)
        embedding, head = (model.get_submodule(name) for name in tied_pair(model))
        assert head.weight is embedding.weight and isinstance(head.weight, DTensor)
        assert all(isinstance(p, DTensor) for p in model.parameters())  # one kind for the optimizer and the norm
        assert model(torch.randint(0, 64, (2, 32))).shape == (2, 32, 128)
    finally:
        dist.destroy_process_group()
