"""loads_bounded: untrusted JSON within a nesting bound, numbers bounded by the interpreter itself
(CPython refuses integer literals over sys.get_int_max_str_digits() digits), no NaN or Infinity,
and every refusal a ValueError."""

from __future__ import annotations

import json
import sys

import pytest
from kv_offload_sidecar.engine.bounded_json import MAX_JSON_DEPTH, loads_bounded


def test_plain_json_parses_to_its_value():
    assert loads_bounded(b'{"op": "lookup", "keys": ["ab"], "timeout": 0.25, "n": -3}') == {
        "op": "lookup", "keys": ["ab"], "timeout": 0.25, "n": -3}


def test_a_long_integer_within_the_interpreters_limit_is_its_value():
    assert loads_bounded("[" + "7" * 100 + "]") == [int("7" * 100)]


def test_an_integer_over_the_interpreters_digit_limit_is_a_value_error():
    with pytest.raises(ValueError, match="digits"):
        loads_bounded('{"timeout": ' + "9" * (sys.get_int_max_str_digits() + 1) + "}")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(constant):
    with pytest.raises(ValueError, match="is not a JSON number"):
        loads_bounded(f'{{"timeout": {constant}}}')


def test_nesting_past_the_bound_is_refused_before_parsing():
    assert loads_bounded("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(ValueError, match="nested deeper"):
        loads_bounded("[" * 5000 + "]" * 5000)
    # Brackets inside strings do not count.
    assert loads_bounded(json.dumps({"s": "[" * 100})) == {"s": "[" * 100}


def test_bad_utf8_and_bad_json_are_value_errors_naming_where():
    with pytest.raises(ValueError, match="not UTF-8 at byte 10"):
        loads_bounded(b'{"step": "\xff"}')
    with pytest.raises(ValueError, match="not JSON"):
        loads_bounded(b'{"step": ')


def test_a_frame_of_many_integers_runs_no_python_code_per_number():
    # Measured: 65,536 row indices took ten times json.loads' time through per-number hooks.
    # Counted, not timed: the frame's numbers are parsed by the interpreter's C scanner.
    frame = json.dumps({"op": "load", "rows": list(range(65536))})
    calls = 0

    def count(frame_, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        value = loads_bounded(frame)
    finally:
        sys.setprofile(None)
    assert value["rows"][-1] == 65535
    assert calls < 50, calls
