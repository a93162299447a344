"""A run that ends normally ends on a checkpoint.

Whatever `run { checkpoint_every }` is, the last step's state is saved
when the run finishes (unless the grid saved it already), the same way a
stop saves it (stopping.checkpoint_at_stop): every trainer rank saves,
then the controller writes the progress. So every finished run can be
exported (`rldsl export RUN_DIR --out DIR`) or continued (`rldsl run
--resume RUN_DIR --steps N`), a 2-step try of a 20-step-grid file too.
"""

from __future__ import annotations

from pathlib import Path


def save_final_checkpoint(pipeline, version: int) -> str | None:
    """The last step's checkpoint of ``pipeline`` (a PipelineDriver whose
    controller has returned) at trainer ``version``: what was saved, or why
    nothing could be, in words for the run's output; None when the grid
    saved it or no step was trained."""
    import ray

    from rldsl.runtime.ray_lowering.checkpoint import checkpoint_dir, complete_checkpoints

    if version <= 0 or checkpoint_dir(pipeline.run_dir, version) in complete_checkpoints(pipeline.run_dir):
        return None
    trainers = pipeline.handles[pipeline.pipe.batch.train_stage]
    try:
        if not ray.get(trainers[0].can_checkpoint.remote()):
            return f"the {pipeline.trainer_engine} trainer keeps no checkpoints"
        saved = ray.get([t.save_checkpoint.remote() for t in trainers])[0]
        if not ray.get(pipeline.controller.save_progress.remote(saved)):
            return f"the final checkpoint {_name(saved)} is incomplete: the controller did not record its progress"
    except ray.exceptions.RayError as err:  # the run trained; say why it cannot be exported, and end as it would
        from rldsl.runtime.ray_lowering.supervision import root_cause

        return f"the final checkpoint could not be saved: {root_cause(err)}"
    return f"final checkpoint: {_name(saved)} ({_relative(pipeline.run_dir)}/checkpoints/{_name(saved)})"


def _name(version: int) -> str:
    return f"v{version:06d}"


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
