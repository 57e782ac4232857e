"""A fault plan out of range is refused at once, naming the field, its value and the bound."""

from __future__ import annotations

import pytest
from kv_offload_tools.chaos.fault_proxy import FaultPlan


@pytest.mark.parametrize(("fields", "said"), [
    ({"mode": "melt"}, "fault mode 'melt' is unknown; use one of ['pass', 'flip', 'truncate', 'delay']"),
    ({"after_bytes": -1}, "after_bytes=-1 must be >= 0"),
    ({"flip_every": 0}, "flip_every=0 must be >= 1"),
    ({"delay_seconds": -0.5}, "delay_seconds=-0.5 must be >= 0"),
])
def test_a_plan_out_of_range_is_refused_naming_field_value_and_bound(fields: dict, said: str) -> None:
    with pytest.raises(ValueError) as refused:
        FaultPlan(**fields)
    assert str(refused.value) == said


def test_the_bounds_themselves_are_accepted() -> None:
    FaultPlan(mode="flip", after_bytes=0, flip_every=1, delay_seconds=0.0)
