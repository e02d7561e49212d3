"""`python -m corpusforge.train` / `torchrun ... -m corpusforge.train`: the `corpusforge train` command."""

from corpusforge.cli.train import train_cmd

if __name__ == "__main__":
    train_cmd(prog_name="python -m corpusforge.train")
