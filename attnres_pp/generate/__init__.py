"""Generation (docs/spec.md section 7): sampling, the generators (single process, in-process pipeline, one
process or Ray actor per rank), the decode loop and `attnres-pp generate`."""
