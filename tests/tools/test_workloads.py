"""Generated conversations: growing prefixes per session, shared system prompts, interleaved turns."""

from __future__ import annotations

import pytest
from kv_offload_tools.bench.replay.cli import route
from kv_offload_tools.mooncake_trace import load_requests, write_requests
from kv_offload_tools.workloads import ConversationSpec, conversation

SPEC = ConversationSpec(sessions=40, turns=5, seed=3)


def test_every_turn_extends_the_previous_prompt_of_its_session():
    requests = conversation(SPEC)
    assert len(requests) == 40 * 5
    by_session: dict[int, list] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 40
    for turns in by_session.values():
        assert len(turns) == 5
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.hash_ids[:len(prev.hash_ids)] == prev.hash_ids  # a growing prefix
            grown = len(nxt.hash_ids) - len(prev.hash_ids)
            assert prev.output_blocks + 1 <= grown <= prev.output_blocks + 3  # answer + user message
            assert nxt.timestamp_ms >= prev.timestamp_ms


def test_sessions_share_a_few_system_prompts_short_and_long_and_interleave():
    requests = conversation(SPEC)
    firsts = {}
    for r in requests:
        firsts.setdefault(r.session, r)
    # the first block names the system prompt: 6 at most, the popular ones shared
    systems = {r.hash_ids[0] for r in firsts.values()}
    assert 2 <= len(systems) <= 6
    lengths = {len(r.hash_ids) - 3 <= 2 for r in firsts.values()}  # short (2 blocks) and long both seen
    assert lengths == {True, False}
    times = [r.timestamp_ms for r in requests]
    assert times == sorted(times)
    sessions = [r.session for r in requests]
    assert any(a != b for a, b in zip(sessions, sessions[1:10]))  # other sessions come in between
    assert conversation(SPEC) == requests  # deterministic per seed
    assert conversation(ConversationSpec(sessions=40, turns=5, seed=4)) != requests


def test_session_affine_routing_keeps_a_conversation_on_one_replica():
    requests = conversation(SPEC)
    routes = route([r.hash_ids for r in requests], 4, "session-affine", sessions=[r.session for r in requests])
    where: dict[int, set[int]] = {}
    for r, replica in zip(requests, routes):
        where.setdefault(r.session, set()).add(replica)
    assert all(len(v) == 1 for v in where.values())
    assert set(routes) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="session_id"):
        route([[1], [2]], 2, "session-affine", sessions=[None, None])


def test_a_written_conversation_reads_back_with_its_sessions(tmp_path):
    requests = conversation(ConversationSpec(sessions=3, turns=2))
    write_requests(tmp_path / "conv.jsonl", requests)
    assert load_requests(tmp_path / "conv.jsonl") == requests


@pytest.mark.parametrize("field, value", [("sessions", 0), ("turns", 0), ("system_prompts", 0)])
def test_bad_conversation_sizes_name_the_flag(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} 0"):
        ConversationSpec(**{"sessions": 2, "turns": 2, field: value})
