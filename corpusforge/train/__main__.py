"""`python -m corpusforge.train` / `torchrun ... -m corpusforge.train`: the `corpusforge train` command.

Its errors are printed as one line by rank 0 only (every rank meets the same bad config); each rank exits with the
error's code, so torchrun reports the failure.
"""

from corpusforge.cli.train import train_cmd

if __name__ == "__main__":
    train_cmd(prog_name="python -m corpusforge.train")
