"""Torch threads per engine actor from the cluster's CPUs (pipeline/cluster_cpus.py)."""

from pipeline.cluster_cpus import threads_per_actor


def test_actors_share_the_cluster_s_cpus():
    assert threads_per_actor(cluster_cpus=16, node_cpus=16, actors=1) == 16
    assert threads_per_actor(cluster_cpus=16, node_cpus=16, actors=3) == 5
    assert threads_per_actor(cluster_cpus=2, node_cpus=2, actors=4) == 1  # at least one


def test_one_actor_never_takes_more_threads_than_its_node_has():
    # two 16-CPU nodes: a lone actor computes on one node's 16 cores, not 32
    assert threads_per_actor(cluster_cpus=32, node_cpus=16, actors=1) == 16
    assert threads_per_actor(cluster_cpus=32, node_cpus=16, actors=2) == 16
    assert threads_per_actor(cluster_cpus=32, node_cpus=16, actors=4) == 8
