"""The per-pod counts and table both demos share: totals add every count, the table aligns."""

from dataclasses import dataclass, field

from kv_offload_tools.pod_table import PodCounts, format_table, total_of


@dataclass
class _Report(PodCounts):
    lookups: int = 0
    seconds: list[float] = field(default_factory=list)


def test_the_total_sums_every_count_and_joins_the_seconds_under_the_total_name() -> None:
    pods = [_Report(f"pod-{i}", f"http://pod-{i}/metrics", requests=3, local_hits=i, peer_hits=2,
                    misses=1, bytes_moved=10, handshake_rejections=1, lookups=5, seconds=[i])
            for i in range(2)]
    total = total_of(pods, _Report)
    assert type(total) is _Report
    assert (total.name, total.metrics_url) == ("total", "")
    assert (total.requests, total.local_hits, total.peer_hits, total.misses) == (6, 1, 4, 2)
    assert (total.bytes_moved, total.handshake_rejections, total.lookups) == (20, 2, 10)
    assert total.seconds == [0, 1]


def test_read_sidecar_takes_bytes_received_and_rejected_handshakes() -> None:
    samples = {("kv_offload_peer_bytes_total", frozenset({("direction", "received")})): 4096.0,
               ("kv_offload_peer_bytes_total", frozenset({("direction", "sent")})): 1.0,
               ("kv_offload_handshakes_total", frozenset({("result", "rejected")})): 3.0}
    pod = PodCounts("pod-0", "")
    pod.read_sidecar(samples)
    assert (pod.bytes_moved, pod.handshake_rejections, pod.answers_given_up) == (4096, 3, 0)
    assert pod.given_up_note() == ""


def test_lookups_given_up_on_a_slow_peer_add_up_over_reasons_and_say_why_hits_may_be_missing() -> None:
    name = "kv_offload_peer_answers_given_up_total"
    samples = {(name, frozenset({("reason", "silence")})): 2.0,
               (name, frozenset({("reason", "deadline")})): 1.0}
    pod = PodCounts("pod-1", "")
    pod.read_sidecar(samples)
    assert pod.answers_given_up == 3
    assert pod.given_up_note().startswith("3 lookups stopped waiting for a slow peer's answer")


def test_table_pads_columns_and_rules_off_the_header_and_the_total() -> None:
    table = format_table(("pod", "hits"), [("pod-0", "7"), ("pod-1", "12"), ("total", "19")])
    assert table.splitlines() == ["pod    hits",
                                  "-----  ----",
                                  "pod-0  7",
                                  "pod-1  12",
                                  "-----  ----",
                                  "total  19"]
