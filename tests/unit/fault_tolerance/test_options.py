"""strategy.fault_tolerance is checked at construction and resolved from the environment torchft's launchers set."""

from __future__ import annotations

import math

import pytest

from lightning_parallel.fault_tolerance.options import FaultTolerance
from lightning_parallel.scaling import lr_factor


def test_fields_come_from_the_environment_when_not_given() -> None:
    env = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3", "TORCHFT_LIGHTHOUSE": "http://host:29510"}
    resolved = FaultTolerance().resolved(env)
    assert (resolved.replica_id, resolved.replicas, resolved.lighthouse) == (1, 3, "http://host:29510")
    assert FaultTolerance(replicas=2, replica_id=0, lighthouse="http://x:1").resolved({}).replicas == 2


@pytest.mark.parametrize(("options", "env", "message"), [
    ({}, {"NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://x:1"}, "REPLICA_GROUP_ID"),
    ({"replicas": 2, "replica_id": 0}, {}, "lighthouse"),
    ({"replicas": 2, "replica_id": 2, "lighthouse": "http://x:1"}, {}, r"\[0, replicas=2\)"),
    ({"replicas": 2, "replica_id": 0, "lighthouse": "http://x:1", "min_replicas": 3}, {}, "min_replicas"),
])
def test_a_missing_or_impossible_value_names_the_fix(options: dict, env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultTolerance(**options).resolved(env)


@pytest.mark.parametrize("config", [{"mode": "allreduce"}, {"lr_rule": "cubic"}, {"timeout": 0},
                                    {"min_replicas": 0}, {"replica": 1}])
def test_bad_options_are_refused_at_construction(config: dict) -> None:
    with pytest.raises(ValueError, match="fault_tolerance"):
        FaultTolerance.from_config(config)


def test_off_values_and_mappings() -> None:
    assert FaultTolerance.from_config(None) is None and FaultTolerance.from_config(False) is None
    assert FaultTolerance.from_config({"replicas": 4}).replicas == 4


@pytest.mark.parametrize("mode", ["ddp", "local_sgd", "diloco", "streaming_diloco"])
def test_every_mode_builds_the_strategy_s_replica_groups(mode: str) -> None:
    from lightning_parallel.strategies import HybridParallelStrategy

    groups = HybridParallelStrategy(fault_tolerance={"mode": mode, "sync_every": 4}).replica_groups
    assert groups is not None and groups.options.mode == mode


@pytest.mark.parametrize(("rule", "expected"), [("linear", 0.5), ("sqrt", math.sqrt(0.5)), ("none", 1.0),
                                                ("fixed_global_batch", 1.0)])
def test_the_learning_rate_follows_the_groups_taking_part(rule: str, expected: float) -> None:
    assert lr_factor(rule, 1, 2) == pytest.approx(expected)
    assert lr_factor(rule, 2, 2) == 1.0
