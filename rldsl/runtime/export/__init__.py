"""A run's trained policy as a Hugging Face model directory (`rldsl export`).

Reads a run directory offline (its plan.json and a trainer checkpoint in
the engine's own format); never starts Ray. ``command`` resolves the run
and writes the directory, ``checkpoints`` reads each engine's files,
``rldsl.models.tiny_gpt2`` maps the builtin model onto GPT-2, ``writer`` saves through
transformers.
"""

from rldsl.runtime.export.command import Exported, export_command, export_run

__all__ = ["Exported", "export_command", "export_run"]
