"""Hypothesis strategies the fuzz targets share: JSON values, keys, key lists, timeouts."""

from __future__ import annotations

from hypothesis import strategies as st

from kv_offload_tools.chaos.fuzz.context import (
    ABSENT_PREFIX,
    HELD_COUNT,
    HELD_PREFIX,
    absent_key,
    held_keys,
)

_leaf = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
# Strings of digits, including ones str.isdigit() accepts but int() does not ("²").
odd_digits = st.text(alphabet="0123456789.-²¹³٣", max_size=8)
# Keys no oracle knows (never held, never known absent).
fuzz_keys = st.binary(min_size=0, max_size=40).filter(
    lambda k: not k.startswith(HELD_PREFIX) and not k.startswith(ABSENT_PREFIX))
# Lists of keys an oracle can answer: held keys (in any order) and known-absent keys.
known_key_lists = st.lists(
    st.one_of(st.integers(0, HELD_COUNT - 1).map(lambda i: held_keys()[i]),
              st.integers(0, 1000).map(absent_key)),
    min_size=0, max_size=10)
# A request's "keys" field: answerable lists, odd items, any JSON.
hex_items = st.one_of(
    known_key_lists.map(lambda ks: [k.hex() for k in ks]),
    st.lists(st.one_of(fuzz_keys.map(bytes.hex), st.text(max_size=12), st.integers(), st.none(),
                       st.just("a" * 8193), st.just("abc")), max_size=6),
    json_values)
# A request's "timeout" field.
timeouts = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 700),
                     st.booleans(), st.text(max_size=5), st.sampled_from([0.05, 0.2, 1.0]))
