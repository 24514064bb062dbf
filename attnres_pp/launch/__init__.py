"""The launch layer: a run decided once from its flags and the machine (`resolve`), the run flags
declared once for every command that starts ranks (`flags`), and how the ranks are started and
hosted: the rank groups (local processes, Ray actors, threads of this process, torchrun's
processes) behind one `RankGroup` interface, the launcher that names one (`launchers`), the Ray
checks, and the rank host (`rank_host.RankHost`) whose contract training's and generation's workers
share. It reads the pipeline and below; it never imports train or generate, whose workers it is
handed as classes.
"""
