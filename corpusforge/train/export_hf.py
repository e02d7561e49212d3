"""The trainer's models as Hugging Face `transformers` checkpoints: GPT -> GPT2LMHeadModel, Llama -> LlamaForCausalLM.

Both are renamings of the same weights, with two differences of layout:
- GPT-2's checkpoint fuses q, k, v into one `c_attn` and stores every linear map as a Conv1D, (in, out), the
  transpose of nn.Linear's (out, in);
- nothing else: the Llama model uses transformers' rotary convention (`rotate_half`), so wq/wk need no permutation.

The vocabulary is exported padded (the logits of the padding rows are those the trainer's model gives).

The tokenizer goes along as a Hugging Face fast tokenizer (corpusforge.tokenizers.hf_fast: a tiktoken encoding
converted, a tokenizer.json copied, a sentencepiece model converted, each checked to give corpusforge's ids): the
one given, else the one the run's data was written with (`P.preprocess.json`). Its end-of-document id is the
config's bos_token_id and eos_token_id (cl100k_base: 100257), so that generate() stops where documents ended in
training. An export is a directory renamed into place whole (see export_hf).

Example:
    >>> out = export_hf("runs/llama-tiny", "runs/llama-tiny/hf")
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> model = AutoModelForCausalLM.from_pretrained(out.output)
    >>> tokenizer = AutoTokenizer.from_pretrained(out.output)
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from corpusforge import fsutil
from corpusforge.errors import CorpusforgeError
from corpusforge.fsutil import temp_path
from corpusforge.train.llama import Llama, LlamaConfig
from corpusforge.train.model import GPT, GPTConfig

# transformers' config keys -> ours: the shape of each family, renamed
HF_LLAMA_KEYS = {"vocab_size": "padded_vocab", "hidden_size": "n_embd", "intermediate_size": "ffn_hidden",
                 "num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
                 "max_position_embeddings": "block_size", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
                 "tie_word_embeddings": "tie_embeddings"}  # fmt: skip
HF_GPT2_KEYS = {"vocab_size": "padded_vocab", "n_positions": "block_size", "n_embd": "n_embd",
                "n_layer": "n_layer", "n_head": "n_head", "resid_pdrop": "dropout", "embd_pdrop": "dropout",
                "attn_pdrop": "dropout"}  # fmt: skip


def hf_config(cfg: GPTConfig | LlamaConfig, bos_token_id: int | None = None, eos_token_id: int | None = None) -> Any:
    """The transformers config of a model config, with the tokenizer's ids (None: no such token; never
    transformers' defaults, GPT-2's 50256 or Llama's 1 and 2, which belong to other vocabularies)."""
    import transformers

    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": None}
    if isinstance(cfg, LlamaConfig):
        scaling = None
        if cfg.rope_scaling:  # Llama 3.1's "llama3" frequency scaling (llama.rope_frequencies)
            scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0,
                       "original_max_position_embeddings": cfg.rope_original_context}  # fmt: skip
        shape = {theirs: getattr(cfg, ours) for theirs, ours in HF_LLAMA_KEYS.items()}
        return transformers.LlamaConfig(**shape, **ids, rope_scaling=scaling, attention_bias=False, mlp_bias=False,
                                        dtype="float32", architectures=["LlamaForCausalLM"])  # fmt: skip
    shape = {theirs: getattr(cfg, ours) for theirs, ours in HF_GPT2_KEYS.items()}
    # gelu_new: the tanh approximation, as model.MLP; GPT-2 always ties the head to the embedding
    return transformers.GPT2Config(**shape, **ids, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                   tie_word_embeddings=True, dtype="float32",
                                   architectures=["GPT2LMHeadModel"])  # fmt: skip


LLAMA_NAMES = {
    "tok_embeddings.": "model.embed_tokens.",
    "attention.wq.": "self_attn.q_proj.",
    "attention.wk.": "self_attn.k_proj.",
    "attention.wv.": "self_attn.v_proj.",
    "attention.wo.": "self_attn.o_proj.",
    "feed_forward.w1.": "mlp.gate_proj.",
    "feed_forward.w3.": "mlp.up_proj.",
    "feed_forward.w2.": "mlp.down_proj.",
    "attention_norm.": "input_layernorm.",
    "ffn_norm.": "post_attention_layernorm.",
}


def llama_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Llama state dict -> LlamaForCausalLM's names (same tensors)."""
    out = {}
    for key, value in state.items():
        name = key
        for ours, theirs in LLAMA_NAMES.items():
            name = name.replace(ours, theirs)
        if name.startswith("layers."):
            name = "model." + name
        elif name == "norm.weight":
            name = "model.norm.weight"
        elif name == "output.weight":
            name = "lm_head.weight"
        out[name] = value
    return out


def gpt_to_hf(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT state dict -> GPT2LMHeadModel's: q/k/v fused into c_attn, linear maps transposed to Conv1D's (in, out);
    zero biases where the model has none (GPT-2 always has them)."""
    C = cfg.n_embd

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return state[name] if name in state else torch.zeros(shape)

    out = {k: state[f"transformer.{k}"] for k in ("wte.weight", "wpe.weight")}
    out = {f"transformer.{k}": v for k, v in out.items()}
    for i in range(cfg.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{theirs}{ln}.weight"] = state[f"{ours}{ln}.weight"]
            out[f"{theirs}{ln}.bias"] = get(f"{ours}{ln}.bias", (C,))
        qkv = [f"{ours}attn.{p}_proj" for p in "qkv"]
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([state[f"{p}.weight"] for p in qkv], 0).T.contiguous()
        out[f"{theirs}attn.c_attn.bias"] = torch.cat([get(f"{p}.bias", (C,)) for p in qkv])
        for mod in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            weight = state[f"{ours}{mod}.weight"]
            out[f"{theirs}{mod}.weight"] = weight.T.contiguous()
            out[f"{theirs}{mod}.bias"] = get(f"{ours}{mod}.bias", (weight.shape[0],))
    out["transformer.ln_f.weight"] = state["transformer.ln_f.weight"]
    out["transformer.ln_f.bias"] = get("transformer.ln_f.bias", (C,))
    out["lm_head.weight"] = state["transformer.wte.weight"]
    return out


def hf_state_dict(state: dict[str, torch.Tensor], cfg: GPTConfig | LlamaConfig) -> dict[str, torch.Tensor]:
    return llama_to_hf(state) if isinstance(cfg, LlamaConfig) else gpt_to_hf(state, cfg)


def to_hf(model: GPT | Llama) -> Any:
    """An in-memory transformers model holding `model`'s weights (float32, eval mode)."""
    return to_hf_from_state({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.cfg)


def to_hf_from_state(state: dict[str, torch.Tensor], cfg: GPTConfig | LlamaConfig) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    hf.load_state_dict(hf_state_dict({k: v.float() for k, v in state.items()}, cfg), strict=True)
    return hf.eval()


# ---------------------------------------------------------------------------------------------------------------
# export-hf: every input checked, then everything written into a temporary directory that is renamed into place


class ExportError(CorpusforgeError, ValueError):
    """An export that cannot be made as asked: its output, its run, or its tokenizer; the message says the fix."""


@dataclass(frozen=True)
class HFExport:
    """What export_hf wrote (the CLI's summary)."""

    output: Path
    checkpoint: Path
    family: str  # "gpt2" | "llama"
    tokenizer: str | None  # the shipped tokenizer's name (an encoding name or a file's path); None: none shipped
    eos_token_id: int | None  # config.json's and generation_config.json's; the tokenizer's end-of-document id
    files: tuple[str, ...]
    replaced: bool  # an earlier export at `output` was replaced (overwrite=True)
    note: str = ""  # why no tokenizer was shipped


@dataclass(frozen=True)
class _Plan:
    """An export whose every input has been checked: nothing is written before it exists."""

    run_dir: Path
    output: Path
    checkpoint: Path
    step: int | None
    mcfg: GPTConfig | LlamaConfig
    tokenizer: Any  # hf_fast.HFTokenizerFiles | None
    note: str
    overwrite: bool


def export_hf(run_dir: str | Path, output: str | Path, checkpoint: str | Path | None = None,
              tokenizer: str | Path | None = None, overwrite: bool = False) -> HFExport:  # fmt: skip
    """Write the latest (or the given) checkpoint of `run_dir` to `output` as a transformers model with its
    tokenizer: model.safetensors, config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, and export.json (what was exported, from where).

    `tokenizer` is a name or a path, as every command takes it (`load_tokenizer`); None: the tokenizer the run's
    data was written with, as `corpusforge preprocess` recorded it (none is shipped when nothing is recorded, and
    then the config has no bos/eos ids). The config's bos/eos ids are that tokenizer's end-of-document id.

    Every input (run, checkpoint, tokenizer, output) is checked before anything is written; the files are written
    into a temporary directory beside `output` and renamed to `output` at the end, so that `output` either does not
    exist or is complete, even after a kill -9. An existing non-empty `output` is refused unless `overwrite`; then
    the new export and the old one are swapped in one step (Linux renameat2 RENAME_EXCHANGE: `output` is always
    the old export or the new one) and the old one deleted; where the file system cannot exchange, it is two
    renames, between which `output` is briefly absent (POSIX has no atomic replacement of a non-empty directory).
    Checkpoints are layout-free (DCP, global names), so a run trained with any tp/pp/FSDP layout exports alike.

    Example:
        >>> export_hf("runs/llama-tiny", "runs/llama-tiny/hf").eos_token_id  # doctest: +SKIP
        100257
    """
    return _write(_plan(Path(run_dir), Path(output), checkpoint, tokenizer, overwrite))


def _plan(run_dir: Path, output: Path, checkpoint: str | Path | None, tokenizer: Any, overwrite: bool) -> _Plan:
    """Every check export_hf makes before it writes anything; the cheap ones first."""
    from corpusforge.train import checkpoint as ckpt
    from corpusforge.train.config import TrainConfig
    from corpusforge.train.trainer import model_config

    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory; give the out_dir of a training run")
    path = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise ckpt.CheckpointError(
            f"{run_dir}: no complete checkpoint under checkpoints/; train first, or give --checkpoint"
        )
    meta = ckpt.load_meta(path)
    ckpt.check_format(path)
    if "config" not in meta:
        raise ckpt.CheckpointError(f"{path}/meta.json: records no config; export a checkpoint written by this version")
    cfg = TrainConfig.from_dict(meta["config"])
    if cfg.family not in ("gpt2", "llama"):
        raise ExportError(
            f"{path}: a {cfg.family} model has no transformers class; export-hf writes the gpt2 and llama families"
        )
    mcfg = model_config(cfg)
    _check_output(output, overwrite, [run_dir, path])
    files, note = _tokenizer(cfg, tokenizer, mcfg)
    return _Plan(run_dir, output, path, meta.get("step"), mcfg, files, note, overwrite)


def _check_output(output: Path, overwrite: bool, inputs: list[Path]) -> None:
    if output.exists() and not output.is_dir():
        raise ExportError(f"{output}: exists and is not a directory; give --output a directory path")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise ExportError(f"{output}: exists and is not empty; give a new --output, or --overwrite to replace it")
        if not (output / "config.json").is_file():  # `--output . --overwrite` must not delete a working directory
            raise ExportError(
                f"{output}: holds no config.json, so it is no earlier export that --overwrite may replace; give a "
                "new --output"
            )
        mine = output.resolve()
        for path in inputs:
            if path.resolve() == mine or mine in path.resolve().parents:
                raise ExportError(f"{output}: holds {path}, which --overwrite would delete; give another --output")
    parent = _existing_parent(output)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{output}: cannot write in {parent} (permission denied); give --output a writable place")


def _existing_parent(path: Path) -> Path:
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"{path}: {parent} is a file, not a directory; give --output a directory path")
    return parent


def _tokenizer(cfg: Any, spec: Any, mcfg: GPTConfig | LlamaConfig) -> tuple[Any, str]:
    """(the fast tokenizer files to ship, or None; why none) for the run `cfg`, given --tokenizer `spec`."""
    from corpusforge.tokenizers import load_tokenizer
    from corpusforge.tokenizers.hf_fast import hf_fast_tokenizer

    recorded, given = _recorded_tokenizers(cfg), spec is not None
    if spec is None and not recorded:
        return None, _why_unrecorded(cfg)
    if spec is None:
        records = {(r.spec, r.fingerprint) for r in recorded.values()}
        if len(records) > 1:
            (a, ra), (b, rb) = list(recorded.items())[:2]
            raise ExportError(
                f"{a} and {b} were written with different tokenizers ({ra.spec or 'cl100k_base'}, "
                f"{rb.spec or 'cl100k_base'}); pass --tokenizer to say which to ship"
            )
        spec = _recorded_spec(next(iter(recorded.values())))
    # the cheap checks on corpusforge's own tokenizer first, then the conversion (seconds for cl100k_base)
    ours = load_tokenizer(spec, engine="reference")
    fingerprints = {r.fingerprint: r for r in recorded.values()}
    if fingerprints and ours.fingerprint not in fingerprints:
        r = next(iter(fingerprints.values()))
        raise ExportError(
            f"--tokenizer {spec}: not the tokenizer the run's data was written with ({r.spec or 'cl100k_base'}, "
            f"recorded in {r.record}); leave --tokenizer out to ship that one"
        )
    if ours.vocab_size > mcfg.vocab_size:
        label = "--tokenizer" if given else "the run's tokenizer"
        raise ExportError(
            f"{label} {spec}: has {ours.vocab_size} ids, more than the "
            f"model's vocabulary ({mcfg.vocab_size}); give the tokenizer the run was trained with"
        )
    return hf_fast_tokenizer(spec, model_max_length=mcfg.block_size), ""


def _recorded_tokenizers(cfg: Any) -> dict[str, Any]:
    """The tokenizer `corpusforge preprocess` recorded for each of the run's datasets that has a record."""
    from corpusforge.data.blended import parse_blend
    from corpusforge.describe import recorded_tokenizer

    if cfg.data.source == "synthetic" or not cfg.data.path:
        return {}
    prefixes, _ = parse_blend(cfg.data.path)
    found = {p: recorded_tokenizer(p) for p in prefixes}
    return {p: r for p, r in found.items() if r is not None}


def _why_unrecorded(cfg: Any) -> str:
    if cfg.data.source == "synthetic" or not cfg.data.path:
        return "the run trained on synthetic tokens; pass --tokenizer to ship one"
    return f"no P.preprocess.json records the tokenizer of {cfg.data.path}; pass --tokenizer to ship one"


def _recorded_spec(recorded: Any) -> str:
    """The recorded tokenizer's spec, checked to name the same tokenizer still (`load_recorded_tokenizer`'s rule)."""
    from corpusforge.tokenizers import TokenizerError, load_tokenizer
    from corpusforge.tokenizers.tiktoken_format import DEFAULT_TOKENIZER

    candidates = [recorded.spec or DEFAULT_TOKENIZER]
    if recorded.spec and not os.path.isabs(recorded.spec):
        candidates.append(str(recorded.record.parent / recorded.spec))
    for spec in candidates:
        try:
            if load_tokenizer(spec, engine="reference").fingerprint == recorded.fingerprint:
                return spec
        except (TokenizerError, OSError):
            continue
    raise ExportError(
        f"{recorded.record}: the run's tokenizer {candidates[0]!r} cannot be found or is no longer the one its data "
        "was written with; pass --tokenizer NAME|PATH naming that tokenizer"
    )


def _write(plan: _Plan) -> HFExport:
    """Write `plan` into a temporary directory beside its output, then rename it into place."""
    parent = plan.output.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(plan.output)
        tmp = temp_path(plan.output)
        tmp.mkdir()
    except OSError as e:
        raise ExportError(
            f"{plan.output}: cannot create it ({e.strerror or e}); give --output a writable place"
        ) from None
    try:
        _write_files(plan, tmp)
        files = tuple(sorted(p.name for p in tmp.iterdir()))
        replaced = _publish(tmp, plan.output, plan.overwrite)
    except OSError as e:
        raise ExportError(
            f"{plan.output}: writing the export failed ({e.strerror or e}); free space or give another --output"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a clean publish
    tok = plan.tokenizer
    return HFExport(plan.output, plan.checkpoint, "llama" if isinstance(plan.mcfg, LlamaConfig) else "gpt2",
                    tok.name if tok else None, tok.eos_id if tok else None, files, replaced, plan.note)  # fmt: skip


def _write_files(plan: _Plan, tmp: Path) -> None:
    """Every file of the export, into `tmp`, each through fsutil's atomic writers (fsynced before the rename)."""
    import safetensors.torch
    from transformers import GenerationConfig

    tok = plan.tokenizer
    config = hf_config(plan.mcfg, tok.bos_id if tok else None, tok.eos_id if tok else None)
    state = _hf_weights(plan, config)
    with fsutil.atomic_path(tmp / "model.safetensors") as path:
        # 0o666 minus the umask, as every other file (safetensors leaves 0o600: others could not read the model)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = os.stat(path).st_mode
        safetensors.torch.save_file(state, path, metadata={"format": "pt"})
        os.chmod(path, mode)
    del state
    fsutil.write_bytes_atomic(tmp / "config.json", config.to_json_string().encode())
    generation = GenerationConfig.from_model_config(config)
    fsutil.write_bytes_atomic(tmp / "generation_config.json", generation.to_json_string().encode())
    for name, data in (tok.files if tok else {}).items():
        fsutil.write_bytes_atomic(tmp / name, data)
    record = {"run_dir": str(plan.run_dir.absolute()), "checkpoint": str(plan.checkpoint.absolute()),
              "step": plan.step, "tokenizer": tok.name if tok else None,
              "tokenizer_fingerprint": tok.fingerprint if tok else None, "eos_token_id": config.eos_token_id,
              "bos_token_id": config.bos_token_id, "note": plan.note}  # fmt: skip
    fsutil.write_json_atomic(tmp / "export.json", record, newline=True)
    fsutil.fsync_dir(tmp)


def _hf_weights(plan: _Plan, config: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under transformers' names, minus the tied head (transformers ties it on load),
    checked against the transformers model's own names and shapes."""
    from transformers import AutoModelForCausalLM

    from corpusforge.train import checkpoint as ckpt
    from corpusforge.train.trainer import build_model

    with torch.device("meta"):  # no initialisation: every weight comes from the checkpoint
        model = build_model(plan.mcfg)
        expected = AutoModelForCausalLM.from_config(config).state_dict()
    model.to_empty(device="cpu")
    if hasattr(model, "reset_buffers"):  # Llama's rotary frequencies are computed, not saved
        model.reset_buffers()
    ckpt.load_model(plan.checkpoint, model)  # DCP assembles each tensor from every rank's shards
    state = hf_state_dict({k: v.detach().float() for k, v in model.state_dict().items()}, plan.mcfg)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    wrong = sorted(set(state) ^ set(expected)) + [k for k in state if k in expected and
                                                  state[k].shape != expected[k].shape]  # fmt: skip
    if wrong:  # a renaming bug, never a user's error: a traceback is right
        raise RuntimeError(f"export-hf: names or shapes differ from transformers' model: {wrong[:5]}")
    return {k: v.contiguous() for k, v in state.items()}


def _publish(tmp: Path, output: Path, overwrite: bool) -> bool:
    """Rename `tmp` to `output`; with `overwrite`, swap it with a non-empty `output` and delete the old one.
    Returns whether an old export was replaced."""
    if overwrite and output.is_dir() and any(output.iterdir()):
        try:
            _exchange(tmp, output)
            old = tmp
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
                raise
            old = temp_path(output)  # no exchange here: two renames, `output` absent between them
            os.rename(output, old)
            os.rename(tmp, output)
        fsutil.fsync_dir(output.absolute().parent)
        shutil.rmtree(old, ignore_errors=True)
        return True
    try:
        os.rename(tmp, output)  # onto nothing, or an empty directory
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ExportError(
                f"{output}: something was written there during the export; give a new --output, or --overwrite"
            ) from None
        raise
    fsutil.fsync_dir(output.absolute().parent)
    return False


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step: Linux renameat2(RENAME_EXCHANGE) (glibc 2.28); OSError where unsupported."""
    import ctypes

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _remove_stale(output: Path) -> None:
    """Delete temporary directories of earlier exports to `output` whose process is gone (killed mid-export)."""
    for leftover in output.absolute().parent.glob(f"{glob.escape(output.name)}.*{fsutil.TMP_SUFFIX}"):
        pid = leftover.name[len(output.name) + 1 :].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
