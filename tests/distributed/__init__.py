"""Whole runs over several processes of this host: rank processes over gloo or shared memory, Ray
actors, the local launcher, fault-tolerant replica groups."""
