"""Several hosts on one machine: network namespaces with a Ray node each (scripts/netns_cluster.py),
and the per-pair transport decision by node identity."""
