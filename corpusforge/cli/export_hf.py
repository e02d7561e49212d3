"""`corpusforge export-hf`: a trained run as a Hugging Face transformers checkpoint (safetensors + config)."""

from __future__ import annotations

from pathlib import Path

import click

from corpusforge.cli import _report


@click.command("export-hf", cls=_report.Command)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--output", required=True, type=click.Path(file_okay=False, path_type=Path), help="Directory to write.")
@click.option("--checkpoint", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A step_* directory; default: the run's latest complete checkpoint.")  # fmt: skip
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path), default=None,
              help="A Hugging Face tokenizer (directory or tokenizer.json) to ship with the model.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def export_hf_cmd(run_dir, output, checkpoint, tokenizer, as_json) -> None:
    """Write RUN_DIR's model (GPT-2 or Llama family) so that AutoModelForCausalLM.from_pretrained(OUTPUT) loads it."""
    from corpusforge.train.export_hf import export_hf

    out = export_hf(run_dir, output, checkpoint, tokenizer)
    files = sorted(p.name for p in out.iterdir())
    data = {"output": str(out), "files": ", ".join(files)}
    _report.print_summary("corpusforge export-hf", list(data.items()), data if as_json else None)
