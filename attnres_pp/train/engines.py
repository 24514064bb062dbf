"""make_engine: the pipelined Engine a RunConfig asks for (launcher local, inprocess or ray)."""

from __future__ import annotations

from attnres_pp.train.config import RunConfig


def make_engine(run_cfg: RunConfig, out_dir=None, *, corpus=None, **launcher_options):
    """`corpus` (the loaded `train.data`) is shared by the in-process launcher's ranks; the others'
    ranks load their own. `launcher_options`: `record_timelines` (every launcher), `fail_at`
    (local and ray), `address` and `placement` (ray)."""
    launcher = run_cfg.pipeline.launcher
    if launcher == "local":
        from attnres_pp.train.process_engine import ProcessEngine

        return ProcessEngine(run_cfg, out_dir, **launcher_options)
    if launcher == "inprocess":
        from attnres_pp.train.inprocess_engine import InProcessEngine

        return InProcessEngine(run_cfg, out_dir, corpus=corpus, **launcher_options)
    if launcher == "ray":
        try:
            from attnres_pp.train.ray_engine import RayEngine
        except ModuleNotFoundError as error:
            if error.name != "attnres_pp.train.ray_engine":
                raise
            raise ValueError("--launcher ray is not available in this build yet: use --launcher local") from None
        return RayEngine(run_cfg, out_dir, **launcher_options)
    raise ValueError(f"launcher={launcher!r} is unknown: choose local, inprocess or ray")
