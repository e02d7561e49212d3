"""`python -m corpusforge.train` / `torchrun ... -m corpusforge.train`: the `corpusforge train` command.

Its errors are printed as one line by rank 0 only. A check that one rank makes (rank 0's index caches, a path that one
node cannot see, a batch with a bad token, a checkpoint write) is agreed by every rank before the next collective
(trainer.Runtime.agree), so every rank ends with that same error, the rank that met it named when the others did not;
each rank exits with the error's code, so torchrun reports the failure with rank 0 as its root cause.
"""

from corpusforge.cli.train import train_cmd

if __name__ == "__main__":
    train_cmd(prog_name="python -m corpusforge.train")
