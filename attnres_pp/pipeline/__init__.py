"""What runs a schedule: chunks, the action executor, the stage runtime,
the split backward and graph cut, routes, clocks, the loopback transports and the generation runtime;
the (dp, pp) mesh and a rank's stage set-up. It reads `attnres_pp.schedule` (what a schedule is);
nothing below it reads this package; how ranks are started is `attnres_pp.launch`, above it.
"""
