"""The pipeline simulator: communication volumes per hop (from the runtime's own payload planner),
cost models, a discrete-event engine over lowered schedules, metrics, Chrome traces and plots.

Never imports torch, torch.distributed or ray: `attnres-pp simulate` starts fast anywhere.
"""
