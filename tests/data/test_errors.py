"""Bad configurations get one clear error that names the problem and the fix."""

from __future__ import annotations

import pytest

from corpusforge.data import build_gpt_datasets, parse_blend


def test_missing_prefix(corpora, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope_text_document\.idx: no such file \(a dataset is the pair"):
        build_gpt_datasets([corpora[0], 0.5, str(tmp_path / "nope_text_document"), 0.5], 32, num_samples=(10, 1, 1))


def test_prefix_given_with_extension_or_as_preprocess_was_told(corpora):
    """The loaders resolve a prefix as inspect does (indexed.require_pair): `x.bin` and preprocess's own
    --output-prefix point to the dataset, and a .bin without its .idx is an interrupted write, never a dataset."""
    prefix = corpora[0]
    with pytest.raises(FileNotFoundError, match=f"no dataset at {prefix}.bin; did you mean {prefix}?"):
        build_gpt_datasets(prefix + ".bin", 32, num_samples=(10, 1, 1))
    with pytest.raises(FileNotFoundError, match=f"did you mean {prefix}?"):
        build_gpt_datasets(prefix.removesuffix("_text_document"), 32, num_samples=(10, 1, 1))


@pytest.mark.parametrize(
    "weights, message",
    [((0, 0), "sum to a positive number"), ((1, -1), "sum to a positive number"), ((2, -1), "must be positive")],
)
def test_weights_that_cannot_be_normalised(corpora, weights, message):
    with pytest.raises(ValueError, match=message):
        build_gpt_datasets([corpora[0], weights[0], corpora[1], weights[1]], 32, num_samples=(10, 1, 1))


def test_blend_orders():
    assert parse_blend(["a", 0.7, "b", "0.3"]) == (["a", "b"], [0.7, 0.3])
    assert parse_blend(["70", "a", "30", "b"]) == (["a", "b"], [70.0, 30.0])  # Megatron's --data-path order
    assert parse_blend("a") == (["a"], None)
    with pytest.raises(ValueError, match="expected prefixes only"):
        parse_blend(["a", 0.7, "b"])


def test_seq_length_longer_than_the_data_repeats_it_with_a_warning(corpora):
    """As megatron-core does (tests/data/test_parity.py compares the samples); a split of no tokens is an error."""
    from corpusforge.data.gpt_dataset import ShortSplitWarning

    short = r"the train split .* holds \d+ tokens, fewer than one sample of 100001: it is repeated \d+ times"
    with pytest.warns(ShortSplitWarning, match=short):
        train, _, _ = build_gpt_datasets(corpora[1], 100_000, num_samples=(10, 0, 0))
    assert len(train) >= 10


def test_weighted_blend_needs_sample_counts(corpora):
    with pytest.raises(ValueError, match=r"needs a sample count for every split; none given for \['valid'"):
        build_gpt_datasets([corpora[0], 1, corpora[1], 1], 32, num_samples=(10, None, 1))


def test_unknown_option_and_bad_split(corpora):
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['eod_mask'\]"):
        build_gpt_datasets(corpora[0], 32, eod_mask=True)
    with pytest.raises(ValueError, match="must sum to a positive number"):
        build_gpt_datasets(corpora[0], 32, split="0,0,0")
    with pytest.raises(ValueError, match="need eod_token_id"):
        build_gpt_datasets(corpora[0], 32, eod_mask_loss=True)


def test_a_short_split_warns_in_one_line_under_the_cli_and_as_a_python_warning_in_a_library(corpora):
    """Under any corpusforge command (the one handler, _report.Command: the trainer's `python -m corpusforge.train`
    too), corpusforge's own warnings are one line on stderr in the CLI's format; outside, an ordinary warning."""
    import os
    import subprocess
    import sys
    import warnings

    from corpusforge.data.gpt_dataset import ShortSplitWarning

    # a real command in a real process, the way `python -m corpusforge.train` starts one: click + _report.Command
    command = (
        "import sys, click\n"
        "from corpusforge.cli import _report\n"
        "from corpusforge.data import build_gpt_datasets\n"
        "@click.command('short', cls=_report.Command)\n"
        "def short():\n"
        "    build_gpt_datasets(sys.argv[1], 100_000, num_samples=(10, 0, 0))\n"
        "    click.echo('built')\n"
        "short(sys.argv[2:], prog_name='corpusforge short')\n"
    )

    def run(**env) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", command, corpora[1]]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, **env})

    # rank 1 of a torchrun job leaves the line to rank 0 (which runs second: the warning does not hang on a cache)
    proc = run(RANK="1", WORLD_SIZE="2")
    assert proc.returncode == 0 and proc.stdout == "built\n" and proc.stderr == "", proc.stderr
    proc = run(RANK="0", WORLD_SIZE="2")
    assert proc.returncode == 0 and proc.stdout == "built\n", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"corpusforge: warning: {corpora[1]}: the train split "), lines
    assert "fewer than one sample of 100001: it is repeated" in lines[0] and "ShortSplitWarning" not in lines[0]
    # a library user: Python's warning, which filters can turn into an error
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortSplitWarning)
        with pytest.raises(ShortSplitWarning):
            build_gpt_datasets(corpora[1], 100_000, num_samples=(10, 0, 0))
