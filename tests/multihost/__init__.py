"""Several hosts on one machine: network namespaces with a Ray node each (`python -m attnres_lab.netns_cluster`),
and the per-pair transport decision by node identity."""
