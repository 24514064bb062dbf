"""`attnres-pp simulate comm | schedule | sweep | project | predict | memory | plan`: the simulator's
command line, one module per subcommand and their shared flags in `flags`.

Flags only fill in the validated objects of the simulator (ModelConfig, CostModel, SweepBase, ...);
a bad value is one line `error: ...` on stderr and exit code 2 (`attnres_pp.cli_flags`). Nothing here
imports torch: the simulator runs where it is missing.
"""

from __future__ import annotations

from attnres_pp.simulator.cli import comm, memory, plan, predict, project, schedule, sweep

# In the order `attnres-pp simulate --help` lists them.
COMMANDS = (comm, schedule, sweep, project, predict, memory, plan)


def register(subparsers) -> None:
    simulate_parser = subparsers.add_parser(
        "simulate", help="simulate communication volumes and pipeline schedules (no torch needed)",
        description="Communication per hop, discrete-event schedule simulation, and sweeps.")
    commands = simulate_parser.add_subparsers(dest="simulate_command", required=True)
    for command in COMMANDS:
        command.register(commands)
