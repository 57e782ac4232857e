"""Mooncake-format traces: the shipped sample loads; a bad file is named down to the line."""

import pytest
from kv_offload_tools.mooncake_trace import TRACE_SAMPLE, load_trace


def test_shipped_trace_sample_is_a_mooncake_trace():
    ids = load_trace(TRACE_SAMPLE)
    assert len(ids) >= 100 and all(ids)
    assert (TRACE_SAMPLE.parent / "NOTICE-mooncake-trace.md").exists()


def test_bad_trace_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*hash_ids"):
        load_trace(str(bad))


def test_requests_without_ids_are_skipped_and_a_trace_without_requests_is_refused(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": []}\n\n{"hash_ids": [7]}\n')
    assert load_trace(trace) == [[7]]
    trace.write_text('{"hash_ids": []}\n')
    with pytest.raises(ValueError, match="no requests"):
        load_trace(trace)
    with pytest.raises(ValueError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
