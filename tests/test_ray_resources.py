"""What a stage asks of a Ray cluster: its declared memory and cores, never more than the
largest live node has (Ray would queue such a task until a node that fits joins)."""

from __future__ import annotations

from graphbuild.sweeps.executors import largest_node, within_largest_node

NODES = [
    {"Alive": True, "Resources": {"CPU": 2.0, "memory": 8e9, "object_store_memory": 1e9}},
    {"Alive": True, "Resources": {"CPU": 8.0, "memory": 4e9}},
    {"Alive": False, "Resources": {"CPU": 64.0, "memory": 512e9}},  # gone: offers nothing
]


def test_the_largest_node_is_the_most_of_each_resource_a_live_node_has():
    assert largest_node(NODES) == {"num_cpus": 8.0, "memory": 8e9}


def test_a_stage_that_fits_a_node_asks_what_it_declared():
    wanted = {"num_cpus": 1, "memory": 3 * 2**30}

    assert within_largest_node(wanted, largest_node(NODES)) == wanted


def test_a_stage_larger_than_every_node_asks_for_the_largest_rather_than_waiting_forever():
    asked = within_largest_node({"num_cpus": 16, "memory": 20 * 2**30}, largest_node(NODES))

    assert asked == {"num_cpus": 8.0, "memory": 8_000_000_000}
    assert isinstance(asked["memory"], int)  # Ray takes bytes as an integer


def test_without_node_facts_the_request_is_unchanged():
    assert within_largest_node({"memory": 5}, {}) == {"memory": 5}
