"""The launch layer: a run decided once from its flags and the machine (`resolve`), the run flags
declared once for every command that starts ranks (`flags`)."""
