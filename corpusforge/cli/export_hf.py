"""`corpusforge export-hf`: a trained run as a Hugging Face transformers checkpoint (safetensors + config)."""

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
    Opt("tokenizer", type=click.Path(exists=True, path_type=Path)),
    exclude=("run_dir",),
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def export_hf_cmd(run_dir, as_json, **options) -> None:
    """Write RUN_DIR's model (GPT-2 or Llama family) so that AutoModelForCausalLM.from_pretrained(OUTPUT) loads it."""
    from corpusforge.train.export_hf import export_hf

    out = export_hf(**asdict(ExportConfig(run_dir=run_dir, **options)))
    files = sorted(p.name for p in out.iterdir())
    data = {"output": str(out), "files": ", ".join(files)}
    _report.print_summary("corpusforge export-hf", list(data.items()), data if as_json else None)
