"""corpusforge's datasets and loaders in the trainers users already run, one thin module per trainer.

Each adapter gives exactly the samples corpusforge's own loader gives (which equal megatron-core's) and resumes
exactly; the trainer's package is imported only by its own module, so none of them is a dependency of the rest.

- `megatron_lm`: a `train_valid_test_datasets_provider` for Megatron-LM's `pretrain_gpt.py`
  (`build_datasets_from_args`), samples typed as megatron-core's.
- `torchtitan`: a dataloader builder for torchtitan's trainer (`CorpusforgeDataLoader.Config`), stateful in its
  checkpoint, resuming exactly at the same or another data-parallel size.
- `grain`: a Grain random-access data source (`GrainSource`, `grain_loader`, `grain_dataset`; torchtitan HEAD,
  MaxText), checkpointed by Grain's own iterator state.
- `lightning`: a `LightningDataModule` (`CorpusforgeDataModule`) whose loader state goes into Lightning's
  checkpoint, counting the batches trained, not those fetched ahead.
- `hf_trainer`: a dataset the Hugging Face `Trainer` takes (`TrainerSamples`, `collate_rows`, `TRAINING_ARGUMENTS`).
"""
