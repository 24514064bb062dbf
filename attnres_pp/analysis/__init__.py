"""What a trained model learned, read after the fact: `attnres-pp analyze` (depth-routing diagnostics of
a checkpoint, evaluated in one process whatever split wrote it) and `attnres-pp plot` (loss curves of
several runs). It loads checkpoints and runs the model forward; it never changes a run.
"""
