"""Fast paths against their slow twins in this process: pipelined steps over the loopback transport
against the single-process model, the split backward against the fused one, tensor parallelism on
thread ranks, generation pipelined against one process, compiled against eager."""
