"""The prefill rate learnt from vLLM's metrics page: the growth of computed prefill tokens over
the growth of prefill seconds, between scrapes."""

from pytest import approx

from kv_offload_sidecar.peers.prefill_rate import PrefillRateLearner, prefill_totals

PAGE = """# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during prefill
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{{engine="0",le="+Inf",model_name="m"}} 3.0
vllm:request_prefill_kv_computed_tokens_count{{engine="0",model_name="m"}} 3.0
vllm:request_prefill_kv_computed_tokens_sum{{engine="0",model_name="m"}} {tokens0}
vllm:request_prefill_kv_computed_tokens_sum{{engine="1",model_name="m"}} {tokens1}
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {seconds0}
vllm:request_prefill_time_seconds_sum{{engine="1",model_name="m"}} {seconds1}
vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} 3.0
"""


def page(tokens: float, seconds: float) -> str:
    return PAGE.format(tokens0=tokens / 2, tokens1=tokens / 2, seconds0=seconds / 2, seconds1=seconds / 2)


def test_totals_add_every_engine_and_ignore_other_series():
    assert prefill_totals(page(1000, 0.5)) == (1000.0, 0.5)
    assert prefill_totals("# nothing\nvllm:num_requests_running 1.0\n") is None


def test_the_rate_is_learnt_between_scrapes_and_averaged():
    learnt: list[float] = []
    learner = PrefillRateLearner("http://127.0.0.1:1/metrics", 1.0, learnt.append)
    assert learner.observe((1000.0, 0.5)) is None  # the first scrape only sets a base
    assert learner.observe((3000.0, 0.7)) == approx(10_000.0)  # 2000 tokens in 0.2 s
    assert learnt == [approx(10_000.0)]
    assert learner.observe((3000.0, 0.7)) is None  # idle: nothing learnt
    assert learner.observe((3500.0, 0.8)) == approx(5000.0)
    assert learnt[-1] == approx(10_000.0 + 0.3 * (5000.0 - 10_000.0))
    assert learner.observe((10.0, 0.01)) is None  # the engine restarted: counters went back


def test_a_sample_is_read_as_its_value_not_its_timestamp():
    # The exposition format lets a sample end in a timestamp (ms); a label value may hold spaces.
    text = ('vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="a b} c"} 1200.0 1700000000000\n'
            "vllm:request_prefill_time_seconds_sum 0.4 1700000000000\n")
    assert prefill_totals(text) == (1200.0, 0.4)


def test_a_malformed_line_is_skipped_and_the_rest_of_the_page_counts():
    text = ("vllm:request_prefill_kv_computed_tokens_sum{engine=\"0\" 12\n"
            + page(1000, 0.5))
    assert prefill_totals(text) == (1000.0, 0.5)
