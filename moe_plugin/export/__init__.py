"""Adapters out of a run: PEFT, per-expert, and merged (Hugging Face or K3 layout) exports that check
themselves before they are published (docs/exports.md). ``moe-plugin export`` is ``command.main``."""

from .exporter import FORMATS, MANIFEST, ExportReport, export_run
from .verify import ExportCheckError

__all__ = ["FORMATS", "MANIFEST", "ExportReport", "ExportCheckError", "export_run"]
