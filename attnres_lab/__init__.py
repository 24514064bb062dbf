"""The measurement lab of attnres-pp: what measures and calibrates the product rather than making it.

Probes of this machine (`unit_probe`, `action_probe`, `link_probe`, `tp_probe`), the studies that
hold the simulator's predictions against measured runs (`fidelity`, `fidelity_tp`, `fidelity_hosts`,
`memory_predict` with its count `memory_count`), the fitting of the simulator's units (`transfer_fit`,
`memory_units`, which writes the calibration file `attnres_pp/simulator/memory_units.json`) and the
harness of several hosts on one machine (`netns_cluster`, with `netns_state` and `netns_host`) and a probe of
one shaped link alone (`shaped_link_probe`). Its command is `attnres-lab`
(`python -m attnres_lab`).

The lab imports attnres_pp; attnres_pp never imports the lab (tests/test_layering.py): the
simulator reads the calibration files the lab writes, never its code.
"""
