"""corpusforge's datasets and loaders in the trainers users already run, one thin module per trainer.

Each adapter gives exactly the samples corpusforge's own loader gives (which equal megatron-core's) and resumes
exactly; the trainer's package is imported only by its own module, so none of them is a dependency of the rest.

- `megatron_lm`: a `train_valid_test_datasets_provider` for Megatron-LM's `pretrain_gpt.py`.
- `torchtitan`: a dataloader builder for torchtitan's trainer, stateful in its checkpoint.
- `grain`: a Grain random-access data source (torchtitan HEAD, MaxText).
- `lightning`: a `LightningDataModule` whose loader state goes into Lightning's checkpoint.
- `hf_trainer`: a dataset the Hugging Face `Trainer` takes.
"""
