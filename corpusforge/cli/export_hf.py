"""`corpusforge export-hf`: a trained run as a Hugging Face transformers model with its tokenizer."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from corpusforge.cli import _report
from corpusforge.cli.config_options import Opt, config_options
from corpusforge.train.config import ExportConfig


@click.command("export-hf", cls=_report.Command)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@config_options(
    ExportConfig,
    Opt("output", type=click.Path(file_okay=False, path_type=Path)),
    Opt("checkpoint", type=click.Path(file_okay=False, path_type=Path)),
    Opt("tokenizer", extra={"metavar": "NAME|PATH"}),
    exclude=("run_dir",),
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def export_hf_cmd(run_dir, as_json, **options) -> None:
    """Write RUN_DIR's model (GPT-2 or Llama family) and its tokenizer so that AutoModelForCausalLM and
    AutoTokenizer .from_pretrained(OUTPUT) load them; OUTPUT appears only once complete."""
    from corpusforge.train.export_hf import export_hf

    done = export_hf(**asdict(ExportConfig(run_dir=run_dir, **options)))
    data = {
        "output": str(done.output),
        "checkpoint": str(done.checkpoint),
        "family": done.family,
        "tokenizer": done.tokenizer or f"none ({done.note})",
        "eos_token_id": done.eos_token_id,
        "files": ", ".join(done.files),
        "replaced": done.replaced,
    }
    rows = {**data, "eos_token_id": "none" if done.eos_token_id is None else str(done.eos_token_id)}  # no "100,257"
    _report.print_summary("corpusforge export-hf", list(rows.items()), data if as_json else None)
