"""Benchmarks of the real pipeline, side by side with the simulator and with
torch.distributed.pipelining: `attnres-pp bench bubbles | comm | overhead | peer`.

`common` holds what they share (run configs, timed steps, the per-action time accounting, result
files); one module per benchmark; `cli` wires them into the `attnres-pp` command line.
"""
