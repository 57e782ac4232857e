"""`kv-offload bench gpu`: the geometry and break-even arithmetic, the rows' verification, and a
CPU run of the whole bench (tiny model, real sidecars) whose fetched rows must be the holder's bytes.

No speed is asserted here: the numbers are the benchmark's output, not a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kv_offload_sidecar.usage import UsageError
from kv_offload_tools.bench.gpu.cli import add_arguments, parse, peer_lengths, sweep_lengths
from kv_offload_tools.bench.gpu.geometry import Geometry, breakeven_gbps, load_model_config, speedup
from kv_offload_tools.bench.gpu.peer import HostRows, lanes_in_use
from kv_offload_tools.bench.gpu.pinning import cpu_list, first_cpus, split_cpus
from kv_offload_tools.bench.gpu.raw_tcp import _shares, raw_tcp
from kv_offload_tools.bench.gpu.prefill import SLICE_LAYERS, layers_to_time, weight_bytes
from kv_offload_tools.bench.gpu.report import targets

GiB = 1 << 30
# Modules the GPU machine's python lacks: the bench and its sidecars must run without them
# (cryptography, which the sidecar needs, travels there as a wheel).
ABSENT_ON_GPU_MACHINE = ("kopf", "kubernetes_asyncio", "ucxx", "nixl")


def _geometry(model: str, chunk_tokens: int = 128) -> Geometry:
    name, config = load_model_config(model)
    return Geometry.of(name, config, chunk_tokens)


def test_llama_8b_and_70b_geometry_is_layers_x_2_x_kv_heads_x_head_dim_x_2_bytes_per_token():
    small, big = _geometry("llama-3.1-8b"), _geometry("llama-3.1-70b")
    assert small.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 128 << 10
    assert big.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2 == 320 << 10
    # vLLM's rows: worker_kv_bytes_per_block (16-token blocks) x blocks_per_chunk.
    assert small.pool.worker_kv_bytes_per_block == 16 * small.kv_bytes_per_token
    assert (small.tokens_per_block, small.blocks_per_chunk) == (16, 8)
    assert small.chunk_bytes == small.pool.kv_bytes_per_chunk == 16 << 20
    assert small.row_stride == small.chunk_bytes  # already page-aligned
    assert small.layer_block_bytes * small.layers * small.blocks_per_chunk == small.chunk_bytes
    # a prompt moves its whole chunks only: the tail shorter than a chunk is recomputed
    assert small.chunks(2048) == 16 and small.kv_bytes(2048) == 256 << 20
    assert small.chunks(2048 + 127) == 16


def test_break_even_is_kv_bytes_over_recompute_time():
    # the H200 figures: Llama-3.1-8B, 2K tokens, 256 MiB recomputed in 62 ms
    assert breakeven_gbps(256 << 20, 0.062) == pytest.approx(4.33, abs=0.01)
    assert breakeven_gbps(2 * GiB, 0.599) == pytest.approx(3.59, abs=0.01)
    assert speedup(0.599, 0.2995) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive"):
        breakeven_gbps(1, 0.0)


def test_a_model_too_big_for_half_the_gpu_is_timed_on_a_layer_slice():
    _, small = load_model_config("llama-3.1-8b")
    _, big = load_model_config("llama-3.1-70b")
    h200 = 141 * 10**9
    assert weight_bytes(small) == pytest.approx(16.06e9, rel=0.01)  # 8.03 B parameters in bf16
    assert weight_bytes(big) == pytest.approx(141.1e9, rel=0.01)
    assert layers_to_time(small, h200) == 32
    assert layers_to_time(big, h200) == SLICE_LAYERS
    assert layers_to_time(big, None) == 80  # the CPU: no memory limit applied


def test_peer_hits_are_left_out_past_the_kv_limit_or_the_free_shared_memory():
    g = _geometry("llama-3.1-70b")  # 320 KiB per token: 48K tokens are 15 GiB of KV
    fits, skipped = peer_lengths(g, [2048, 16384, 49152], 8 * GiB, 64 * GiB)
    assert fits == [2048, 16384] and set(skipped) == {49152}
    assert "--max-kv-gib 8" in skipped[49152]
    fits, skipped = peer_lengths(g, [2048, 16384], 8 * GiB, 4 * GiB)
    assert fits == [2048] and "shared memory" in skipped[16384]


def test_lane_sweeps_run_at_the_asked_lengths_else_the_shortest_and_longest():
    assert sweep_lengths([1024, 2048, 16384, 49152], [2048, 16384]) == [2048, 16384]
    assert sweep_lengths([256, 512, 1024], [2048, 16384]) == [256, 1024]


def test_raw_tcp_streams_split_the_bytes_and_land_them_all():
    assert _shares(10, 4) == [3, 3, 2, 2] and sum(_shares(1 << 20, 8)) == 1 << 20
    raw = raw_tcp(2, 1 << 20, 1, *split_cpus(os.sched_getaffinity(0)))
    assert raw["streams"] == 2 and raw["gbps"] > 0 and len(raw["runs_s"]) == 1


def test_the_lanes_in_use_are_read_from_the_fetchers_status_where_it_states_them():
    assert lanes_in_use({"data_lanes": {"holder": 4}, "data_lanes_offered": 8}) == 4
    assert lanes_in_use({"data_lanes": {}}) is None
    assert lanes_in_use({"identity": "fetcher"}) is None  # a sidecar without lanes


def test_holder_and_fetcher_get_half_the_cpus_each():
    assert split_cpus(range(16)) == (list(range(8)), list(range(8, 16)))
    assert split_cpus([0, 1]) == ([0], [1])
    assert split_cpus([3]) == ([3], [3])
    assert cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_sidecar_cpus_give_each_sidecar_the_first_cpus_of_its_half_and_no_more_than_the_half():
    halves = split_cpus(range(16))
    assert first_cpus(halves, 1) == ([0], [8])
    assert first_cpus(halves, 4) == ([0, 1, 2, 3], [8, 9, 10, 11])
    assert first_cpus(halves, 8) == halves
    with pytest.raises(ValueError, match=r"sidecar CPUs 9: each sidecar has 8 CPUs of its own here \(1-8\)"):
        first_cpus(halves, 9)


def test_sidecar_cpus_beyond_half_this_hosts_cpus_are_refused_naming_the_flag_and_the_most(shm_dir: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    most = len(split_cpus(os.sched_getaffinity(0))[1])
    args = parser.parse_args(["--models", "tiny-llama", "--shm-dir", shm_dir, "--sidecar-cpus", f"1,{most + 1}"])
    with pytest.raises(UsageError, match=rf"--sidecar-cpus '1,{most + 1}': sidecar CPUs {most + 1}: .*\(1-{most}\)"):
        parse(args, cuda=False)
    ok = parse(parser.parse_args(["--models", "tiny-llama", "--shm-dir", shm_dir, "--sidecar-cpus", "1"]), cuda=False)
    assert [count for count, _ in ok["sidecar_cpus"]] == [1]


def test_rows_verification_tells_landed_chunks_from_zeroed_or_corrupted_ones(shm_dir: str):
    rows = HostRows(shm_dir, 4, 8192, 4096 + 512, "cpu")
    try:
        digests = rows.fill(4)
        assert len(set(digests)) == 4  # each chunk's bytes differ from the others'
        assert rows.matches(digests)
        rows.zero(4)
        assert not rows.matches(digests)
        assert rows.fill(4) == digests  # the same content again
        rows.chunk(3)[100] ^= 1
        assert not rows.matches(digests)
        assert (rows.rows[:, 4096 + 512:] == 0).all()  # padding past the chunk untouched
    finally:
        rows.close()


def _blocked_modules(path: Path) -> str:
    """A folder of stand-ins for what the GPU machine lacks: importing one fails."""
    for name in ABSENT_ON_GPU_MACHINE:
        (path / name).mkdir(parents=True)
        (path / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    return str(path)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A two-layer tiny Llama's config.json, written under ``tmp_path``."""
    config = dict(load_model_config("tiny-llama")[1], num_hidden_layers=2)
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def _bench_gpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kv-offload bench gpu ARGS`` in a child process, its output captured."""
    return subprocess.run([sys.executable, "-m", "kv_offload_operator.cli", "bench", "gpu", *args],
                          capture_output=True, text=True, timeout=240, env=env)


def test_cpu_run_fetches_the_holders_bytes_into_the_rows_and_reports_every_phase(
        tmp_path: Path, shm_dir: str, model: Path):
    plot, out = tmp_path / "gpu.png", tmp_path / "gpu.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_blocked_modules(tmp_path / "absent"), *sys.path])
    done = _bench_gpu("--models", str(model), "--lengths", "256,512", "--chunk-tokens", "64", "--repeats", "2",
                      "--json", str(out), "--plot", str(plot), "--shm-dir", shm_dir, "--timeout-s", "30", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "tiny: 2 KiB of KV per token" in done.stdout  # the table, with the JSON in its file
    assert report["device"] == "cpu" and report["plane"] == "tcp" and report["lanes"] == ["default"]
    assert set(report["pinning"]) == {"holder", "fetcher"}
    (m,) = report["models"]
    g = m["geometry"]
    assert g["name"] == "tiny" and g["kv_bytes_per_token"] == 2 * 2 * 4 * 64 * 2
    assert g["chunk_bytes"] == 64 * g["kv_bytes_per_token"]  # 128 KiB chunks
    assert m["prefill_layers_timed"] == 2 and m["layer_scale"] == 1
    assert [r["tokens"] for r in m["rows"]] == [256, 512]
    for row in m["rows"]:
        assert row["chunks"] == row["tokens"] // 64
        assert row["kv_bytes"] == row["chunks"] * g["chunk_bytes"]
        assert row["recompute_s"] > 0 and len(row["recompute_runs_s"]) == 2
        assert row["breakeven_gbps"] == pytest.approx(row["kv_bytes"] / row["recompute_s"] / 1e9)
        (hit,) = row["peer"]
        # the fetcher found every chunk at its peer and landed all of them, byte for byte
        assert (hit["found_local"], hit["found_peer"], hit["loaded"]) == (0, row["chunks"], row["chunks"])
        assert hit["identical"] and hit["all_loaded"]
        assert hit["hit_s"] == pytest.approx(hit["lookup_s"] + hit["fetch_s"] + hit["h2d_s"])
        assert min(hit["lookup_s"], hit["fetch_s"], hit["h2d_s"]) > 0 and len(hit["hit_runs_s"]) == 2
        # the fixed cost before bytes move: the first chunk, requested with the lookup, verified
        assert 0 < hit["first_chunk_s"] < hit["hit_s"]
        assert hit["speedup"] == pytest.approx(row["recompute_s"] / hit["hit_s"])
        assert hit["fetch_gbps"] > 0 and hit["hit_gbps"] > 0
        assert hit["holder_cpu_s_per_gb"] >= 0 and hit["fetcher_cpu_s_per_gb"] >= 0
        assert hit["ratio_to_raw_tcp"] > 0
        # the fetcher's event loop answered /healthz polls all through the hit
        assert hit["healthz_polls"] >= 1 and hit["healthz_p99_ms"] > 0
    (pool,) = m["pools"]
    assert pool["lanes"] == "default" and pool["store_s"] > 0 and pool["data_scheme"] == "tcp"
    # stored as beside an engine on a GPU (not paced), landed before the fetcher saw it, against
    # a memcpy of the same bytes
    assert not pool["store_paced"] and 0 < pool["store_landed_s"] <= pool["store_s"]
    assert pool["store_memcpy_s"] > 0 and pool["store_bytes"] == m["rows"][-1]["kv_bytes"]
    assert pool["lanes_in_use"] in (None, 1)  # the sidecars' own choice on one CPU each
    # raw TCP with as many streams as the sidecars' own lane choice, the longest hit's bytes
    raw = pool["raw_tcp"]
    assert raw["streams"] == (pool["lanes_in_use"] or 1) and raw["gbps"] > 0
    assert raw["bytes"] == m["rows"][-1]["kv_bytes"]
    assert len(raw["runs_s"]) == 2 and raw["sender_cpu_s_per_gb"] >= 0 and raw["receiver_cpu_s_per_gb"] >= 0
    # a 2-core host measures none of the GPU targets, and these prompts' KV is under the 1 GiB
    # the store's and the /healthz targets are stated for
    assert report["targets"] == []
    assert plot.stat().st_size > 0
    assert "[bench gpu" in done.stderr


def test_the_tls_plane_moves_the_hit_under_mutual_tls_into_the_rows(
        tmp_path: Path, shm_dir: str, model: Path):
    out = tmp_path / "gpu.json"
    done = _bench_gpu("--models", str(model), "--plane", "tls", "--lengths", "256", "--chunk-tokens", "64",
                      "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "gpu.png"),
                      "--shm-dir", shm_dir, "--timeout-s", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (m,) = report["models"]
    (pool,) = m["pools"]
    assert report["plane"] == "tls" and pool["data_scheme"] == "tls"
    (hit,) = m["rows"][0]["peer"]
    assert hit["identical"] and hit["all_loaded"] and hit["loaded"] == m["rows"][0]["chunks"]


def test_sidecar_cpus_add_a_pair_on_that_many_cpus_each_whose_lanes_follow_its_cores(
        tmp_path: Path, shm_dir: str, model: Path):
    out = tmp_path / "gpu.json"
    done = _bench_gpu("--models", str(model), "--lanes", "2", "--sidecar-cpus", "1", "--lengths", "256,512",
                      "--sweep-lengths", "512", "--chunk-tokens", "64", "--repeats", "1", "--json", str(out),
                      "--plot", str(tmp_path / "gpu.png"), "--shm-dir", shm_dir, "--timeout-s", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["sidecar_cpus"] == [1]
    (m,) = report["models"]
    halves = split_cpus(os.sched_getaffinity(0))
    lanes_pool, cpus_pool = m["pools"]
    assert (lanes_pool["lanes"], lanes_pool["sidecar_cpus"]) == (2, None)
    assert (lanes_pool["holder_cpus"], lanes_pool["fetcher_cpus"]) == (cpu_list(halves[0]), cpu_list(halves[1]))
    # the added pair: each sidecar on one CPU, its lanes its own choice, one per core
    assert (cpus_pool["lanes"], cpus_pool["sidecar_cpus"]) == ("default", 1)
    assert (cpus_pool["holder_cpus"], cpus_pool["fetcher_cpus"]) == (str(halves[0][0]), str(halves[1][0]))
    assert cpus_pool["lanes_in_use"] == 1 and cpus_pool["raw_tcp"]["streams"] == 1
    short, long_ = m["rows"]
    assert [(p["lanes"], p["sidecar_cpus"]) for p in short["peer"]] == [(2, None)]  # not a sweep length
    assert [(p["lanes"], p["sidecar_cpus"]) for p in long_["peer"]] == [(2, None), ("default", 1)]
    assert all(p["identical"] and p["all_loaded"] for p in long_["peer"])
    assert "1cpu" in done.stdout and "lanes default, 1 CPUs each (1 in use)" in done.stdout


def _peer(lanes: int, gbps: float, raw_ratio: float, speedup_: float) -> dict:
    return {"lanes": lanes, "fetch_gbps": gbps, "ratio_to_raw_tcp": raw_ratio, "speedup": speedup_}


def test_gpu_targets_are_judged_on_hosts_with_eight_cpus_for_llama_8b():
    rows = [{"tokens": 2048, "kv_bytes": 256 << 20, "recompute_s": 0.062,
             "peer": [_peer(1, 1.5, 0.8, 0.5), _peer(4, 5.0, 0.9, 1.4), _peer(8, 9.0, 0.85, 2.2)]},
            {"tokens": 16384, "kv_bytes": 2 << 30, "recompute_s": 0.6,
             "peer": [_peer(1, 1.8, 0.9, 0.9), _peer(4, 5.0, 0.9, 1.9), _peer(8, 8.0, 0.7, 2.5)]}]
    report = {"cpus": 16, "models": [{"geometry": {"name": "llama-3.1-8b"}, "rows": rows, "pools": []}]}
    got = {(t["target"], t["tokens"]): (round(t["value"], 3), t["met"]) for t in targets(report)}
    assert got == {
        ("4 lanes >= 3x the rate of 1 lane", 2048): (3.333, True),
        ("4 lanes >= 3x the rate of 1 lane", 16384): (2.778, False),
        # raw TCP with 8 streams is judged at the longest prompt with an 8-lane hit
        ("8 lanes >= 0.8x raw TCP with 8 streams", 16384): (0.7, False),
        ("peer hit >= 2x faster than recompute", 16384): (2.5, True),
    }
    # a pair on fewer CPUs (--sidecar-cpus) is not judged by the lanes' targets
    for row in rows:
        row["peer"].append({**_peer(8, 0.1, 0.01, 0.1), "sidecar_cpus": 1})
    assert {(t["target"], t["tokens"]): (round(t["value"], 3), t["met"]) for t in targets(report)} == got
    assert targets({**report, "cpus": 2}) == []  # a small host cannot give lanes cores
    assert targets({**report, "models": [{"geometry": {"name": "tiny"}, "rows": rows, "pools": []}]}) == []


def test_the_store_and_healthz_targets_are_judged_on_any_host_from_one_gib():
    hit = {"lanes": 2, "healthz_p99_ms": 12.0}
    rows = [{"tokens": 1024, "kv_bytes": 128 << 20, "peer": [{**hit, "healthz_p99_ms": 50.0}]},
            {"tokens": 8192, "kv_bytes": 1 << 30, "peer": [hit]}]
    pools = [{"lanes": 2, "store_paced": False, "store_bytes": 1 << 30, "store_landed_s": 0.3,
              "store_memcpy_s": 0.15},
             {"lanes": 4, "store_paced": False, "store_bytes": 512 << 20, "store_landed_s": 9.0,
              "store_memcpy_s": 0.1}]
    report = {"cpus": 2, "models": [{"geometry": {"name": "tiny"}, "rows": rows, "pools": pools}]}
    got = {(t["target"], t["tokens"]): (round(t["value"], 3), t["met"]) for t in targets(report)}
    assert got == {
        ("an unpaced store lands in the holder within 2.5x a memcpy of its bytes (lanes 2)", 8192): (2.0, True),
        ("the fetcher answers /healthz with p99 <= 10 ms while 1 GiB arrive (lanes 2)", 8192): (12.0, False),
    }  # the 512 MiB store and the 128 MiB hit are under the 1 GiB the targets are stated for
