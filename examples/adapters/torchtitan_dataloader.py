"""torchtitan 0.3.0 training on corpusforge's data: a config-registry function whose dataloader is corpusforge's.

Copy `llama3_corpusforge` into your own config registry (or point --module at this file) and set `blend` to your
token datasets. The tiny example data, with a tokenizer that fits the debug model's 2048-token vocabulary:

    corpusforge train-tokenizer examples/tiny-corpus.jsonl.zst --vocab-size 2048 --output out/tok2k/tokenizer.json
    corpusforge preprocess examples/tiny-corpus.jsonl.zst --output-prefix out/tiny2k \\
        --tokenizer out/tok2k/tokenizer.json

Train (a GPU machine; torchtitan's trainer does not run without an accelerator), kill it, run it again: it resumes
from its last checkpoint with the next batches, also with another --nproc-per-node (same global batch size):

    PYTHONPATH=examples/adapters torchrun --nproc-per-node=2 -m torchtitan.train \\
        --module torchtitan_dataloader --config llama3_corpusforge --dataloader.blend out/tiny2k_text_document

On CPU, this script shows what the trainer gets: it builds the dataloader as torchtitan's Trainer does, takes three
batches, saves the state and resumes a new loader from it.

    python examples/adapters/torchtitan_dataloader.py out/tiny2k_text_document
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from corpusforge.adapters.torchtitan import CorpusforgeDataLoader


def llama3_corpusforge() -> Trainer.Config:
    """torchtitan's llama3 debug model, fed by corpusforge (10 steps of 8 x 2048 tokens per data-parallel rank)."""
    config = llama3_debugmodel()
    config.hf_assets_path = "out/tok2k"  # the tokenizer the data was made with (torchtitan reads tokenizer.json)
    config.checkpoint.enable = True
    config.checkpoint.interval = 5
    config.validator.enable = False  # torchtitan's validator takes its own HF dataloader config
    steps = config.training.steps
    config.dataloader = CorpusforgeDataLoader.Config(
        blend=["out/tiny2k_text_document"],  # or ["out/a_text_document", "0.7", "out/b_text_document", "0.3"]
        split="99,1,0",
        seed=1234,
        num_samples=steps * config.training.local_batch_size * 8,  # enough for up to 8 data-parallel ranks
        cache_dir="out/index-cache",
    )
    return config


def main(prefix: str) -> None:
    config = llama3_corpusforge()
    config.dataloader.blend = [prefix]
    config.dataloader.cache_dir = str(Path(prefix).parent / "index-cache")

    def build(dp_rank: int = 0, dp_world_size: int = 1) -> CorpusforgeDataLoader:
        # what torchtitan's Trainer calls (torchtitan/trainer.py); seq_len 128 keeps this quick on the tiny data
        return config.dataloader.build(dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=None, seq_len=128,
                                       local_batch_size=4, snapshot_every_n_steps=None)  # fmt: skip

    loader = build()
    it = iter(loader)
    for step in range(3):
        inputs, labels = next(it)
        print(f"step {step}: input {tuple(inputs['input'].shape)} {inputs['input'].dtype}, first ids "
              f"{inputs['input'][0, :6].tolist()}, labels without loss {(labels == -100).sum().item()}")  # fmt: skip
    state = loader.state_dict()  # what torchtitan's CheckpointManager saves as "dataloader"
    expected = next(it)[0]["input"]
    resumed = build()
    resumed.load_state_dict(state)
    same = bool((next(iter(resumed))[0]["input"] == expected).all())
    print(f"state: {len(state['corpusforge'])} bytes of JSON for {state['world_size']} dp rank(s); resumed, the next "
          f"batch is the same: {same}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/tiny2k_text_document")
