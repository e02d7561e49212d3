"""The trainer's models as Hugging Face `transformers` checkpoints: GPT -> GPT2LMHeadModel, Llama -> LlamaForCausalLM.

Both are renamings of the same weights, with two differences of layout:
- GPT-2's checkpoint fuses q, k, v into one `c_attn` and stores every linear map as a Conv1D, (in, out), the
  transpose of nn.Linear's (out, in);
- nothing else: the Llama model uses transformers' rotary convention (`rotate_half`), so wq/wk need no permutation.

The vocabulary is exported padded (the logits of the padding rows are those the trainer's model gives), and
the tokenizer goes along when the run's tokenizer is a Hugging Face one (a directory or a tokenizer.json).

Example:
    >>> out = export_hf("runs/llama-tiny", "runs/llama-tiny/hf")
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_pretrained(out)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

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


def hf_config(cfg: GPTConfig | LlamaConfig) -> Any:
    """The transformers config of a model config."""
    import transformers

    if isinstance(cfg, LlamaConfig):
        scaling = None
        if cfg.rope_scaling:  # Llama 3.1's "llama3" frequency scaling (llama.rope_frequencies)
            scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0,
                       "original_max_position_embeddings": cfg.rope_original_context}  # fmt: skip
        shape = {theirs: getattr(cfg, ours) for theirs, ours in HF_LLAMA_KEYS.items()}
        return transformers.LlamaConfig(**shape, rope_scaling=scaling, attention_bias=False, mlp_bias=False,
                                        dtype="float32")  # fmt: skip
    shape = {theirs: getattr(cfg, ours) for theirs, ours in HF_GPT2_KEYS.items()}
    # gelu_new: the tanh approximation, as model.MLP; GPT-2 always ties the head to the embedding
    return transformers.GPT2Config(**shape, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                   tie_word_embeddings=True, dtype="float32")  # fmt: skip


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


def export_hf(run_dir: str | Path, output: str | Path, checkpoint: str | Path | None = None,
              tokenizer: str | Path | None = None) -> Path:  # fmt: skip
    """Write the latest (or the given) checkpoint of `run_dir` to `output` as model.safetensors + config.json,
    with `tokenizer` (a Hugging Face tokenizer directory or tokenizer.json) copied beside them; returns `output`.
    Checkpoints are layout-free (DCP, global names), so a run trained with any tp/pp/FSDP layout exports alike."""
    from corpusforge.train import checkpoint as ckpt
    from corpusforge.train.config import TrainConfig
    from corpusforge.train.trainer import build_model, model_config

    run_dir, output = Path(run_dir), Path(output)
    path = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise ckpt.CheckpointError(
            f"{run_dir}: no complete checkpoint under checkpoints/; train first, or give --checkpoint"
        )
    meta = ckpt.load_meta(path)
    if "config" not in meta:
        raise ckpt.CheckpointError(f"{path}/meta.json: records no config; export a checkpoint written by this version")
    mcfg = model_config(TrainConfig.from_dict(meta["config"]))
    with torch.device("meta"):  # no initialisation: every weight comes from the checkpoint
        model = build_model(mcfg)
    model.to_empty(device="cpu")
    if hasattr(model, "reset_buffers"):  # Llama's rotary frequencies are computed, not saved
        model.reset_buffers()
    hf = to_hf(ckpt.load_model(path, model))  # DCP assembles each tensor from every rank's shards
    output.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(output, safe_serialization=True)
    if tokenizer:
        _copy_tokenizer(Path(tokenizer), output)
    return output


def to_hf_from_state(state: dict[str, torch.Tensor], cfg: GPTConfig | LlamaConfig) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    hf.load_state_dict(hf_state_dict({k: v.float() for k, v in state.items()}, cfg), strict=True)
    return hf.eval()


def _copy_tokenizer(src: Path, output: Path) -> None:
    """Copy a Hugging Face tokenizer: a directory's tokenizer files, or one tokenizer.json."""
    from corpusforge.errors import CorpusforgeError

    if src.is_dir() and (src / "tokenizer.json").is_file():
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
                shutil.copy2(f, output / f.name)
    elif src.is_file() and src.name.endswith(".json"):
        shutil.copy2(src, output / "tokenizer.json")
    else:
        raise CorpusforgeError(f"{src}: not a Hugging Face tokenizer (a directory with tokenizer.json, or a .json)")
