"""A Prometheus exposition read into numbers: labels kept, samples summed by label subset."""

from kv_offload_testing.scrape import parse_metrics, total, value

EXPOSITION = """\
# HELP kv_offload_peer_bytes_total Chunk bytes moved between peers.
# TYPE kv_offload_peer_bytes_total counter
kv_offload_peer_bytes_total{direction="sent"} 4096.0
kv_offload_peer_bytes_total{direction="received"} 1024.0
# HELP kv_offload_handshakes_total Handshakes.
# TYPE kv_offload_handshakes_total counter
kv_offload_handshakes_total{reason="ok",result="accepted"} 2.0
kv_offload_handshakes_total{reason="replay",result="rejected"} 3.0
kv_offload_handshakes_total{reason="bad_proof",result="rejected"} 1.0
# HELP kv_offload_peer_fetch_duration_seconds Fetch time.
# TYPE kv_offload_peer_fetch_duration_seconds histogram
kv_offload_peer_fetch_duration_seconds_bucket{le="0.01"} 1.0
kv_offload_peer_fetch_duration_seconds_bucket{le="+Inf"} 2.0
kv_offload_peer_fetch_duration_seconds_count 2.0
kv_offload_peer_fetch_duration_seconds_sum 0.5
"""


def test_every_sample_is_keyed_by_name_and_label_pairs():
    samples = parse_metrics(EXPOSITION)
    assert samples[("kv_offload_peer_bytes_total", frozenset({("direction", "sent")}))] == 4096
    assert samples[("kv_offload_peer_fetch_duration_seconds_count", frozenset())] == 2
    assert samples[("kv_offload_peer_fetch_duration_seconds_bucket", frozenset({("le", "+Inf")}))] == 2


def test_value_sums_the_samples_whose_labels_include_the_ones_asked():
    samples = parse_metrics(EXPOSITION)
    assert value(samples, "kv_offload_handshakes_total", result="rejected") == 4
    assert value(samples, "kv_offload_handshakes_total", reason="replay") == 3
    assert value(samples, "kv_offload_handshakes_total") == 6
    assert value(samples, "kv_offload_evictions_total") == 0
    assert total([samples, samples], "kv_offload_peer_bytes_total", direction="received") == 2048
