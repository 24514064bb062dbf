"""Checks of one part of the project in this process (model, schedules, simulator, data, checkpoints, the
command line, benchmarks); a test here that starts a child process carries its process marker."""
