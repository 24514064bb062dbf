"""Every benchmark, `attnres-pp bench NAME`: the real pipeline side by side with the simulator and
with torch.distributed.pipelining, the model's quality and memory, and the kernels on a GPU.

One module per benchmark (with its own flags); `common` holds what they share (run configs, timed
steps, the per-action time accounting, and the one results writer); `cli` is the registry of
benchmarks and the harness that parses, runs and writes each of them.
"""
