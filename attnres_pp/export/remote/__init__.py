"""The code an exported AttnRes folder carries (`configuration_attnres.py`, `modeling_attnres.py`):
copied beside its weights and loaded by transformers with `trust_remote_code=True`, so it imports
only torch and transformers, never attnres_pp."""
