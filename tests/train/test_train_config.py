"""TrainConfig: TOML + overrides, one docstring per key, errors before anything is built."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
import warnings
from dataclasses import fields
from pathlib import Path

import pytest

from corpusforge.train.config import (
    SECTIONS,
    ConfigDeprecationWarning,
    ConfigError,
    OptimizerSection,
    ScheduleSection,
    TrainConfig,
    config_keys,
    grad_accum_steps,
    key_docs,
    load_config,
    parse_override,
)
from corpusforge.train.optim import lr_at

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_every_key_has_a_docstring():
    docs = key_docs()
    keys = [f.name for f in fields(TrainConfig) if f.name not in SECTIONS]
    keys += [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in fields(cls)]
    missing = [k for k in keys if not docs.get(k)]
    assert missing == [] and len(keys) > 60
    batch = docs["schedule.global_batch_tokens"]
    assert "global batch" in batch.lower() or "optimizer step" in batch


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigDeprecationWarning)  # the shipped configs are written the new way
        cfg = load_config(path)
    assert cfg.data.path
    if cfg.model.name != "custom":
        assert grad_accum_steps(cfg, 8) >= 1  # the presets divide on one node of 8 GPUs


def test_overrides_are_toml_values_or_strings(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[data]\npath = "x"\n[optimizer]\nlr = 1e-3\n')
    cfg = load_config(
        f,
        [
            "optimizer.lr=3e-4",
            "compile=false",
            "out_dir=runs/a",
            'data.path=["a", 0.3, "b", 0.7]',
            "schedule.warmup-steps=5",
        ],
    )
    assert (cfg.optimizer.lr, cfg.compile, cfg.out_dir, cfg.schedule.warmup_steps) == (3e-4, False, "runs/a", 5)
    assert cfg.data.path == ["a", 0.3, "b", 0.7]
    assert parse_override("schedule.min_lr=0") == ("schedule.min_lr", 0)
    min_lr = load_config(None, ["schedule.min_lr=0"]).schedule.min_lr
    assert min_lr == 0.0 and isinstance(min_lr, float)


def test_old_flat_keys_are_read_with_one_warning_each_naming_the_new_key(tmp_path):
    f = tmp_path / "old.toml"
    f.write_text('data_path = "x"\nlr = 1e-3\nmodel = "gpt2-350m"\n[parallel]\ntp = 2\n')
    with pytest.warns(ConfigDeprecationWarning) as caught:
        cfg = load_config(f, ["max_steps=7", "schedule.warmup_steps=3"])
    assert [str(w.message) for w in caught] == [
        f"{f}: key 'data_path' is deprecated; write data.path (in a file: [data] path = ...)",
        f"{f}: key 'lr' is deprecated; write optimizer.lr (in a file: [optimizer] lr = ...)",
        f"{f}: key 'model' is deprecated; write model.name (in a file: [model] name = ...)",
        "command line: max_steps=7: key 'max_steps' is deprecated; write schedule.max_steps (in a file: [schedule] "
        "max_steps = ...)",
    ]
    new = load_config(None, ['data.path="x"', "optimizer.lr=1e-3", 'model.name="gpt2-350m"', "parallel.tp=2",
                             "schedule.max_steps=7", "schedule.warmup_steps=3"])  # fmt: skip
    assert cfg == new and cfg.model_shape() == (24, 16, 1024)


def test_a_checkpoint_of_flat_keys_reads_and_compares_as_the_new_keys():
    old = {"max_steps": 40, "lr": 1e-3, "seed": 1, "storage": {"read_mode": "pread"}, "parallel": {"tp": 1}}
    assert TrainConfig.from_dict(old) == load_config(
        None, ["schedule.max_steps=40", "optimizer.lr=1e-3", "seed=1", 'storage.read_mode="pread"']
    )
    now = load_config(None, ["schedule.max_steps=80"]).to_dict()
    assert config_keys(old)["schedule.max_steps"] == 40 and config_keys(now)["schedule.max_steps"] == 80
    assert TrainConfig.from_dict(now).schedule.max_steps == 80


def test_unknown_key_in_file_names_the_file_and_suggests(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("learning_rate = 1e-3\nmax_step = 5\n")  # neither an old nor a new key
    with pytest.raises(ConfigError, match=r"c\.toml: unknown key 'learning_rate'"):
        load_config(f)


def test_unknown_key_in_override_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown key 'max_step'; did you mean schedule\.max_steps"):
        load_config(None, ["max_step=5"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=fast", "command line: optimizer.lr=fast: expected a number"),
        ("schedule.max_steps=0", "schedule.max_steps = 0: must be at least 1"),
        ("parallel=tp", "choose one of"),
        ("compile=maybe", "compile"),
        ("schedule.min_lr=1", "min_lr 1.0 is above optimizer.lr"),
        ("model.n_head=5", "not a multiple of n_head"),
        ("optimizer.lr.x=1", r"write optimizer\.KEY=value"),
    ],
)
def test_bad_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_sections_and_bad_toml_are_refused(tmp_path):
    (tmp_path / "a.toml").write_text("[training]\nsteps = 2\n")
    with pytest.raises(ConfigError, match=r"\[training\]: not a section; the sections are \[model\]"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text("lr = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "b.toml")
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml")


def test_batch_that_does_not_divide_says_what_would():
    cfg = load_config(
        None, ["schedule.micro_batch_size=8", "model.seq_length=1024", "schedule.global_batch_tokens=500000"]
    )
    with pytest.raises(
        ConfigError, match=r"not a multiple of .* = 16384; use e\.g\. schedule\.global_batch_tokens=507904"
    ):
        grad_accum_steps(cfg, 2)
    assert grad_accum_steps(load_config(None, []), 8) == 8  # 524288 / (8 * 1024 * 8)


def test_lr_schedule_warmup_cosine_floor():
    cfg = TrainConfig(
        optimizer=OptimizerSection(lr=1.0), schedule=ScheduleSection(min_lr=0.1, warmup_steps=10, max_steps=110)
    )
    lrs = [lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1) and lrs[119] == 0.1
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # never rises after warmup


@pytest.mark.parametrize("cls", [TrainConfig, *SECTIONS.values()], ids=lambda c: c.__name__)
def test_docstrings_are_attribute_docstrings(cls):
    # Guard the form key_docs() reads: a string right after each annotated field.
    body = ast.parse(inspect.getsource(cls)).body[0].body
    names = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
    assert names == [f.name for f in fields(cls)]


def test_a_storage_section_loads_and_reaches_the_dataset(tmp_path):
    import json

    from trainkit import tiny_overrides, write_markov_corpus

    from corpusforge.storage import StorageConfig
    from corpusforge.train.data import build_data

    prefix = write_markov_corpus(tmp_path / "m_text_document")
    f = tmp_path / "run.toml"
    f.write_text(
        "[storage]\n"
        'read_mode = "pread"\n'
        "block_size = 1048576\n"
        f'local_cache_dir = "{tmp_path / "local"}"\n'
        "local_cache_max_bytes = 1_000_000_000\n"
        "[storage.storage_options]\n"
        'endpoint_url = "http://127.0.0.1:7480"\n'
        'secret = "s3cr3t"\n'
    )
    cfg = load_config(f, tiny_overrides(prefix, tmp_path / "run", eval_interval=0) + ["storage.cache_blocks=3"])
    assert cfg.storage == StorageConfig(
        read_mode="pread",
        block_size=1 << 20,
        cache_blocks=3,
        local_cache_dir=str(tmp_path / "local"),
        local_cache_max_bytes=1_000_000_000,
        storage_options={"endpoint_url": "http://127.0.0.1:7480", "secret": "s3cr3t"},
    )
    assert json.loads(json.dumps(cfg.to_dict()))["storage"]["storage_options"]["secret"] == "<redacted>"
    data = build_data(cfg, rank=0, world_size=1)
    reader = data.train.dataset.indexed
    assert reader.read_mode == "pread" and reader.source == prefix  # read as configured...
    assert reader.prefix.startswith(str(tmp_path / "local"))  # ...from the local cache tier's copy
    assert data.read_modes == {prefix: "pread (configured)"}
    assert next(iter(data.train))["tokens"].shape == (8, 32)


@pytest.mark.parametrize(
    "section, override, message",
    [
        ('read_mod = "pread"', None, r"unknown key 'read_mod' in \[storage\]; did you mean read_mode"),
        ('read_mode = "fast"', None, r"\[storage\]: read_mode 'fast': choose one of"),
        ('block_size = "big"', None, r"c\.toml: storage\.block_size = 'big': expected a whole number"),
        ('storage_options = "http://x"', None, "storage_options = 'http://x': expected a table"),
        ("", "storage.local_cache_max_bytes=-1", "local_cache_max_bytes must be positive"),
        ("", "storage.nope.x=1", "write storage.KEY=value or storage.storage_options.KEY=value"),
        ("", "storage.auto_direct_above_bytes=-5", "auto_direct_above_bytes must not be negative"),
    ],
)
def test_bad_storage_settings_are_config_errors(tmp_path, section, override, message):
    f = tmp_path / "c.toml"
    f.write_text(f'[data]\npath = "x"\n[storage]\n{section}\n')
    with pytest.raises(ConfigError, match=message):
        load_config(f, [override] if override else [])


def test_retro_encoder_lr_scale_reaches_the_model_and_is_checked():
    """[retro] encoder_lr_scale is the model's encoder learning-rate fraction; outside (0, 1] it is one line."""
    from corpusforge.train.trainer import retro_config

    cfg = load_config(CONFIGS / "retro-tiny-cpu.toml", ["retro.encoder_lr_scale=0.5", "retro.db=db/"])
    assert retro_config(cfg).encoder_lr_scale == 0.5
    assert retro_config(load_config(CONFIGS / "retro-tiny-cpu.toml", ["retro.db=db/"])).encoder_lr_scale == 0.1
    with pytest.raises(ConfigError, match="encoder_lr_scale 1.5 must be in"):
        retro_config(load_config(CONFIGS / "retro-tiny-cpu.toml", ["retro.encoder_lr_scale=1.5", "retro.db=db/"]))


@dataclasses.dataclass(frozen=True)
class Choice:
    mode: typing.Literal["mmap", "pread"] = "mmap"


# Every kind of field type the trainer's config has, a value of another type, and how the error names the type.
TYPED = [
    ("model.n_layer", '"x"', "a whole number"),
    ("optimizer.lr", '"fast"', "a number"),
    ("model.bias", "1", "true or false"),
    ("model.name", "5", "a string"),
    ("data.path", "3", "a string or a list"),
    ("parallel.pp_layers", "2", "a list of whole numbers"),
    ("compile", "3", "true or false or a string"),
    ("seed", "1.5", "a whole number"),
    ("storage.auto_direct_above_bytes", '"x"', "a whole number"),
    ("storage.local_cache_dir", "3", "a string"),
    ("storage.storage_options", "3", "a table"),
]


def _toml(key: str, text: str) -> str:
    section, _, leaf = key.rpartition(".")
    return f"[{section}]\n{leaf} = {text}\n" if section else f"{key} = {text}\n"


@pytest.mark.parametrize("key, text, words", TYPED, ids=[k for k, _, _ in TYPED])
def test_a_value_of_the_wrong_type_names_its_source_and_the_type_in_words(tmp_path, key, text, words):
    """In a file: the file, the key and the value; on the command line: the override as typed. Never the other
    source, never a Python class."""
    f = tmp_path / "c.toml"
    f.write_text(_toml(key, text))
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"{f}: {key} = ") and f": expected {words}" in str(e.value), e.value
    good = tmp_path / "good.toml"
    good.write_text("[model]\nn_layer = 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(good, [f"{key}={text}"])
    assert str(e.value).startswith(f"command line: {key}={text}: expected {words}"), e.value
    assert str(good) not in str(e.value) and "<class" not in str(e.value)


def test_a_string_read_as_a_number_says_how_to_quote_it():
    with pytest.raises(ConfigError, match='command line: model.name=5: expected a string; quote it: model.name="5"'):
        load_config(None, ["model.name=5"])


@pytest.mark.parametrize("key", ["model.n_layers", "n_layers", "schedule.max_step", "storage.read_mod"])
def test_an_unknown_key_names_its_source_and_the_close_key(tmp_path, key):
    leaf = key.rpartition(".")[2]
    f = tmp_path / "c.toml"
    f.write_text(_toml(key, "2"))
    good = tmp_path / "good.toml"
    good.write_text("[model]\nn_layer = 2\n")
    for source, args in ((str(f), (f, [])), (f"command line: {key}=2", (good, [f"{key}=2"]))):
        with pytest.raises(ConfigError) as e:
            load_config(*args)
        message = str(e.value)
        assert message.startswith(f"{source}: unknown key {(leaf if '.' in key else key)!r}"), message
        assert "did you mean" in message and str(good) not in message, message
    with pytest.raises(ConfigError, match=r"command line: model\.n_layers=2: unknown key 'n_layers' in \[model\]; "
                                          r"did you mean model\.n_layer\?"):  # fmt: skip
        load_config(good, ["model.n_layers=2"])


def test_a_bad_value_is_blamed_on_the_source_of_the_keys_it_names(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[optimizer]\nlr = 1e-3\n[model]\ndropout = 0.1\n")
    with pytest.raises(ConfigError, match=r"^command line: model\.dropout=2: model\.dropout = 2\.0: must be in"):
        load_config(f, ["model.dropout=2"])
    with pytest.raises(ConfigError, match=r"^command line: schedule\.min_lr=1 and .*c\.toml: schedule\.min_lr 1\.0 is"):
        load_config(f, ["schedule.min_lr=1"])
    f.write_text("[model]\ndropout = 2.0\n")
    with pytest.raises(ConfigError, match=rf"^{f}: model\.dropout = 2\.0: must be in"):
        load_config(f, ["optimizer.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"^command line: storage\.read_mode=fast: \[storage\]: read_mode 'fast'"):
        load_config(f, ["model.dropout=0", "storage.read_mode=fast"])
    with pytest.raises(ConfigError, match=r"^command line: device=gpu: device = 'gpu': choose one of .*did you mean"):
        load_config(f, ["model.dropout=0", "device=gpu"])


def test_type_words_cover_literal_choices():
    """A Literal field lists its choices; a value of it is accepted as it is."""
    from corpusforge.configs import from_table, type_words

    assert from_table(Choice, {"mode": "pread"}, "x.toml", ConfigError).mode == "pread"
    with pytest.raises(ConfigError, match=r"^x\.toml: mode = 'direct': expected one of 'mmap', 'pread'$"):
        from_table(Choice, {"mode": "direct"}, "x.toml", ConfigError)
    assert type_words(float | None) == "a number" and type_words(dict[str, int]) == "a table"
