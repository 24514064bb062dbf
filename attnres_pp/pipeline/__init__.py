"""What runs a schedule and how ranks are started: chunks, the action executor, the stage runtime,
the split backward and graph cut, routes, clocks, the loopback transports and the generation runtime;
rank processes, the (dp, pp) mesh, stage set-up and the Ray checks. It reads `attnres_pp.schedule`
(what a schedule is); nothing below it reads this package.
"""
