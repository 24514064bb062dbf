"""What a schedule is (docs/spec.md section 5), as data: the action IR (`ir`), one generator per schedule
(`schedules`), the communication pass (`passes`), the validators under buffered and NCCL rules
(`validate`, `validate_nccl`, sharing `prerequisites`), the lockstep issue plan, the forward-only
schedules of evaluation and generation (`forward_schedule`), and the timeline
accounting and trace events that real runs and the simulator share (`timeline`, `trace`).

Pure Python, no torch: the layer the simulator reads. `pipeline` runs what this package describes.
"""
