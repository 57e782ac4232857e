"""Bench records: the README's results, the benchmarks page's tables and each record's page
equal what the dated JSON records render; a bench run with --record writes one."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from kv_offload_operator import cli
from kv_offload_tools import bench_records as records
from kv_offload_tools.bench_records.prose import NOT_MEASUREMENTS, figures_in, loose_figures
from kv_offload_tools.bench_records.readme import results_md
from kv_offload_tools.bench_records import shape
from kv_offload_tools.bench_records.render import expected, render_blocks
from kv_offload_tools.bench_records.shape import Column, Figures, Table, convert, key, markdown_tables
from kv_offload_tools.bench_records.tables import gpu, transport

REPO = records.REPO
# Tables in the docs that hold no measured figures (lists of pages, settings, rules, words).
NOT_FIGURES = ("| where the peers are |", "| page |", "| | what it is |", "| plane | between |", "| contract |",
               "| word |", "| vLLM |", "| where | the key is |", "| connection | rule |", "| surface |",
               "| limit | default |", "| install | brings |", "| reason | what is missing |", "| what you see |")


def test_the_readme_the_benchmarks_page_and_every_record_page_equal_what_the_records_render():
    stale = [str(path.relative_to(REPO)) for path, text in expected().items()
             if not path.exists() or path.read_text() != text]
    assert stale == [], ("these differ from what docs/benchmarks/*/*.json render; run "
                         "`python -m kv_offload_tools.bench_records --write` (after editing the JSON, "
                         "not the rendered text)")


def test_every_figure_table_of_the_readme_and_the_docs_is_rendered_from_a_record():
    pages = [REPO / "README.md", *(p for p in sorted((REPO / "docs").rglob("*.md"))
                                   if not {"reference", "benchmarks"} & set(p.relative_to(REPO / "docs").parts[:-1]))]
    headers = []
    for page in pages:
        outside = re.sub(r"<!-- bench:[^>]*-->\n.*?<!-- /bench -->|```.*?```", "", page.read_text(), flags=re.S)
        lines = outside.splitlines()
        headers += [f"{page.relative_to(REPO)}: {ln}" for ln, below in zip(lines, lines[1:])
                    if re.match(r"^\|[-:| ]+\|$", below) and not ln.startswith(NOT_FIGURES)]
    assert headers == [], ("a table typed by hand: make it a record's table and a bench block, or add its "
                           "header to NOT_FIGURES if it holds no measurement")


def test_the_readme_results_are_a_rendered_block():
    readme = (REPO / "README.md").read_text()
    assert re.search(r"<!-- bench:results -->\n\| what \|.*\n<!-- /bench -->", readme, re.S)


def test_every_imported_record_says_where_its_figures_were_typed_and_is_dated_by_a_commit():
    for bench in records.benches():
        for path in records.record_paths(records.RECORDS_DIR, bench):
            r = records.load(path)
            assert r["bench"] == bench and path.name.startswith(r["date"])
            if r["imported"]:
                assert re.match(r"\S+\.md at [0-9a-f]{12}", r["imported"])
                assert re.fullmatch(r"[0-9a-f]{40}", r["commit"])
            for name in r.get("figures", {}):
                if r["imported"] or name in r.get("figures_imported", {}):
                    assert re.fullmatch(r"\S+\.md at [0-9a-f]{12} \(\d{4}-\d{2}-\d{2}\)",
                                        r.get("figures_imported", {}).get(name, "")), (path, name)


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md"])
def test_every_figure_in_the_readme_and_the_benchmarks_page_comes_from_a_record(page):
    allowed = {text for text, _ in NOT_MEASUREMENTS}
    loose = [f"{page}:{line}: {figure}" for line, figure in loose_figures((REPO / page).read_text())
             if figure not in allowed]
    assert loose == [], ("figures typed by hand: put each into its bench's record (`figures`) and the "
                         "prose between `<!-- figure:BENCH.KEY -->` markers (CONTRIBUTING.md, Figures), or, "
                         "if it is not a measurement, into prose.NOT_MEASUREMENTS saying why")


def test_what_counts_as_a_figure_is_a_number_with_a_unit_outside_code_links_and_markers():
    text = ("TCP 1.17x raw TCP, 0.98-1.00x, +68.8 ms, 2.64 GB/s, 39.0 MiB, 45 %, 3 GB; not 4 pods, vLLM 0.33, "
            "`--sizes-mib 512 MiB`, [a](b.md#at-2-s), <!-- figure:x.y -->5 ms<!-- /figure -->\n"
            "```\n9 ms\n```\n")
    assert [f for _, f in loose_figures(text)] == ["1.17x", "0.98-1.00x", "+68.8 ms", "2.64 GB/s", "39.0 MiB",
                                                   "45 %", "3 GB"]
    assert figures_in("a 1.5x b <!-- figure:x.y -->5 ms<!-- /figure --> c 2 s") == ["1.5x", "2 s"]


def test_a_passage_holding_a_single_figure_is_skipped_to_its_own_end():
    text = ("<!-- figures:x@2026-01-01.y -->\nA 1.5x B <!-- figure:x.z -->5 ms<!-- /figure --> C 2 s\n"
            "<!-- /figures -->\nloose 3 ms\n")
    assert [f for _, f in loose_figures(text)] == ["3 ms"]


def _transport_report(tcp: float, ucx: float, ucx2: float) -> dict:
    def row(method: str, size: int, ratio: float) -> dict:
        return {"method": method, "chunk_bytes": size, "gbps_median": 2.0 * ratio, "ratio_to_raw_tcp": ratio,
                "holder_cpu_seconds_per_gb": 0.2, "fetcher_cpu_seconds_per_gb": 0.1}
    return {"results": [row("raw_tcp", 16 << 20, 1.0), row("raw_tcp_2streams", 16 << 20, 1.5),
                        row("tcp", 16 << 20, tcp), row("tcp_2lanes", 16 << 20, 1.3),
                        row("ucx_sm", 16 << 20, ucx), row("ucx_sm_2lanes", 16 << 20, ucx2)]}


def _copy_of_the_records(tmp_path: Path) -> Path:
    directory = tmp_path / "docs" / "benchmarks"
    shutil.copytree(records.RECORDS_DIR, directory)
    return directory


def test_a_newer_transport_record_is_what_the_readme_transfer_row_quotes(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    records.write(directory, {"bench": "transport", "date": "2099-01-02", "commit": "", "host": {"cores": 2},
                              "command": "kv-offload bench transport", "imported": "",
                              "tables": transport(_transport_report(1.25, 2.5, 3.75)), "notes": {}})
    page = tmp_path / "README.md"
    table = results_md(records.latest(directory), directory, page)
    assert "TCP **1.25x** raw TCP, UCX shared memory **2.50x** (two lanes 3.75x)" in table
    assert "[2099-01-02](docs/benchmarks/transport/2099-01-02.md)" in table


def test_a_record_without_a_row_the_readme_quotes_is_an_error_naming_the_row(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    report = _transport_report(1.0, 2.0, 3.0)
    report["results"] = [r for r in report["results"] if r["method"] != "ucx_sm"]
    records.write(directory, {"bench": "transport", "date": "2099-01-02", "commit": "", "host": {},
                              "command": "", "imported": "", "tables": transport(report), "notes": {}})
    with pytest.raises(KeyError, match=r"transport record 2099-01-02, table 1.*'kv-offload UCX sm \(default"):
        results_md(records.latest(directory), directory, tmp_path / "README.md")


def test_a_newer_record_without_tables_is_an_error_asking_for_a_renderer(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    records.write(directory, {"bench": "gpu", "date": "2099-01-02", "commit": "", "host": {}, "command": "",
                              "imported": "", "tables": [], "report": {}, "notes": {}})
    with pytest.raises(KeyError, match="gpu record 2099-01-02 has 0 tables.*record.py"):
        results_md(records.latest(directory), directory, tmp_path / "README.md")


def test_rendering_a_rendered_page_changes_nothing_and_a_block_names_an_unknown_bench(tmp_path):
    page = REPO / "docs" / "benchmarks.md"
    assert render_blocks(page.read_text(), records.RECORDS_DIR, page) == page.read_text()
    with pytest.raises(KeyError, match="bench:nosuch names no bench"):
        render_blocks("<!-- bench:nosuch table:1 -->\n<!-- /bench -->", records.RECORDS_DIR, page)


def test_the_transport_table_shows_lanes_beside_raw_tcp_with_as_many_streams():
    rows = transport(_transport_report(1.0, 2.0, 3.0))[0]["rows"]
    assert ["16 MiB", "kv-offload TCP, 2 lanes (raw TCP, 2 streams: 3.00)", "2.60", "1.30", "0.20 / 0.10"] in rows
    assert not any("raw_tcp_2streams" in r[1] for r in rows)


def test_a_newer_gpu_record_is_what_the_readme_h200_row_quotes(tmp_path):
    def peer(lanes: int, hit_s: float, gbps: float, speedup: float) -> dict:
        return {"lanes": lanes, "hit_s": hit_s, "fetch_gbps": gbps, "speedup": speedup}
    report = {"models": [{"geometry": {"name": "llama-3.1-8b"}, "rows": [
        {"tokens": 2048, "kv_bytes": 256 << 20, "recompute_s": 0.061, "peer": [peer(8, 0.032, 11.1, 1.9)]},
        {"tokens": 16384, "kv_bytes": 2 << 30, "recompute_s": 1.5,
         "peer": [peer(1, 0.7, 3.1, 0.8), peer(8, 0.25, 15.25, 6.0)]}]}]}
    (table,) = gpu(report)
    assert table["columns"] == ["Llama-3.1-8B", "recompute", "peer hit, 1 lane", "8 lanes", "speedup (8 lanes)"]
    assert table["rows"][0] == ["2K (256 MiB)", "61 ms", "", "32 ms (11.1 GB/s)", "1.90x"]
    directory = _copy_of_the_records(tmp_path)
    records.write(directory, {"bench": "gpu", "date": "2099-01-02", "commit": "", "host": {}, "command": "",
                              "imported": "", "tables": [table], "notes": {}})
    readme = results_md(records.latest(directory), directory, tmp_path / "README.md")
    assert "recompute 1.50 s; **peer hit 250 ms (6.00x faster, 15.2 GB/s)**" in readme


@pytest.fixture
def fake_benches(tmp_path, monkeypatch):
    """Two benches the dispatcher knows: one with --json, one that prints text only."""
    (tmp_path / "fake_json_bench.py").write_text(textwrap.dedent("""
        import json
        def add_arguments(p):
            p.add_argument("--json", action="store_true")
            p.add_argument("--size", type=int, default=1)
        def run(args):
            print(json.dumps({"size": args.size}) if args.json else f"size {args.size}")
            return 1
    """))
    (tmp_path / "fake_path_bench.py").write_text(textwrap.dedent("""
        import json
        def add_arguments(p):
            p.add_argument("--json", default="", metavar="PATH")
        def run(args):
            print("a table")
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"rows": 3}, fh)
    """))
    (tmp_path / "fake_text_bench.py").write_text(textwrap.dedent("""
        def add_arguments(p):
            pass
        def run(args):
            print("figures: 42")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.BENCHES, "fakejson", ("fake_json_bench", "a bench with --json"))
    monkeypatch.setitem(cli.BENCHES, "faketext", ("fake_text_bench", "a bench without"))
    monkeypatch.setitem(cli.BENCHES, "fakepath", ("fake_path_bench", "a bench with --json PATH"))
    yield tmp_path
    for name in ("fake_json_bench", "fake_text_bench", "fake_path_bench"):
        sys.modules.pop(name, None)


def test_a_bench_run_with_record_writes_the_days_json_and_page_and_keeps_its_exit_code(fake_benches, capsys):
    out = fake_benches / "records"
    assert cli.main(["bench", "fakejson", "--size", "7", "--record", str(out)]) == 1
    assert json.loads(capsys.readouterr().out) == {"size": 7}  # still printed
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    r = json.loads((out / "fakejson" / f"{today}.json").read_text())
    assert (r["bench"], r["date"], r["report"], r["exit_code"], r["imported"]) == ("fakejson", today, {"size": 7},
                                                                                   1, "")
    assert r["command"] == f"kv-offload bench fakejson --size 7 --record {out}"
    assert r["host"]["cores"] >= 1 and "cpu_model" in r["host"] and r["commit"]
    assert "| measured | " + today + " |" in (out / "fakejson" / f"{today}.md").read_text()
    assert cli.main(["bench", "fakejson", "--record", str(out)]) == 1
    assert [p.name for p in records.record_paths(out, "fakejson")] == [f"{today}.json", f"{today}-2.json"]


def test_a_bench_without_json_is_recorded_with_what_it_printed(fake_benches):
    out = fake_benches / "records"
    assert cli.main(["bench", "faketext", "--record", str(out)]) == 0
    (path,) = records.record_paths(out, "faketext")
    assert records.load(path)["output"] == "figures: 42\n"
    assert "figures: 42" in path.with_suffix(".md").read_text()


def test_a_bench_run_without_record_writes_nothing(fake_benches, capsys):
    assert cli.main(["bench", "faketext"]) == 0
    assert capsys.readouterr().out == "figures: 42\n"
    assert not (fake_benches / "records").exists()


def _record_with_figures(directory: Path, date: str, figures: dict) -> None:
    records.write(directory, {"bench": "replay", "date": date, "commit": "", "host": {}, "command": "",
                              "imported": "", "tables": [], "notes": {}, "figures": figures})


def test_a_figure_marker_is_filled_from_the_newest_record_and_a_pinned_one_from_its_run(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    _record_with_figures(directory, "2099-01-02", {"hit_ratio_vs_one_lru": "0.50-0.60x"})
    page = tmp_path / "README.md"
    text = ("ratio <!-- figure:replay.hit_ratio_vs_one_lru -->0.98-1.00x<!-- /figure -->, then "
            "<!-- figure:replay@2026-12-01.hit_ratio_vs_one_lru -->9x<!-- /figure -->")
    assert render_blocks(text, directory, page) == (
        "ratio <!-- figure:replay.hit_ratio_vs_one_lru -->0.50-0.60x<!-- /figure -->, then "
        "<!-- figure:replay@2026-12-01.hit_ratio_vs_one_lru -->0.98-1.00x<!-- /figure -->")


def test_a_newest_record_without_a_quoted_figure_fails_naming_the_key(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    _record_with_figures(directory, "2099-01-02", {})
    with pytest.raises(KeyError, match=r"replay/2099-01-02.json has no text figure 'hit_ratio_vs_one_lru'"):
        render_blocks("<!-- figure:replay.hit_ratio_vs_one_lru -->0.98x<!-- /figure -->", directory,
                      tmp_path / "README.md")


def test_a_passage_takes_its_figures_in_order_and_a_figure_added_by_hand_is_an_error(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    _record_with_figures(directory, "2099-01-02", {"run": ["1.10x", "20 ms"]})
    page = tmp_path / "docs" / "benchmarks.md"
    passage = "<!-- figures:replay@2099-01-02.run -->\nwas 9.99x in `5 ms` and 7 ms ([x](y.md#2-s))\n<!-- /figures -->"
    assert render_blocks(passage, directory, page) == passage.replace("9.99x", "1.10x").replace("7 ms", "20 ms")
    with pytest.raises(ValueError, match=r"the passage has 3 figures and the record 2"):
        render_blocks(passage.replace(")\n", ") and 3 s\n"), directory, page)


def test_the_pages_under_docs_with_markers_are_rendered_too():
    assert REPO / "docs" / "how-to" / "size-a-gpu-pool.md" in expected()


def test_a_bench_names_its_columns_once_and_convert_builds_the_records_tables_and_figures(monkeypatch):
    named = Figures(tables=(Table("Rates", lambda r: r["rows"], (Column("size", key("size", fmt="{} MiB")),
                                                                  Column("rate", key("gbps", fmt="{:.2f} GB/s")))),),
                    figures={"best": lambda r: f"{max(x['gbps'] for x in r['rows']):.1f} GB/s"})
    monkeypatch.setattr(shape, "spec", lambda bench: named)
    report = {"rows": [{"size": 2, "gbps": 1.234}, {"size": 16, "gbps": 2.5}]}
    assert convert("fake", report) == {
        "tables": [{"title": "Rates", "columns": ["size", "rate"], "align": ["---", "---"],
                    "rows": [["2 MiB", "1.23 GB/s"], ["16 MiB", "2.50 GB/s"]]}],
        "figures": {"best": "2.5 GB/s"}}
    with pytest.raises(KeyError, match=r"bench fake: table 'Rates', column 'rate', row 2: the report has no 'gbps'"):
        convert("fake", {"rows": [{"size": 2, "gbps": 1.0}, {"size": 16}]})
    assert convert("fake", None) == {"tables": [], "figures": {}}


def test_every_bench_that_publishes_figures_names_them_in_its_record_module():
    for bench in ("transport", "gpu", "vllm", "replay", "scale", "mesh", "netns", "chaos"):
        assert isinstance(shape.spec(bench), Figures), bench
    assert shape.spec("descriptors") is None


def test_a_bench_that_prints_markdown_tables_gets_them_as_its_records_tables():
    text = ("bench x\n| plane | TTFT |\n|---|---|\n| tcp | 0.354 s |\n| ucx | 0.305 s |\n\n"
            "| a |\n|---|\n| 1 |\n[target] ok")
    first, second = markdown_tables(text, "TTFT")
    assert first == {"title": "TTFT: table 1", "columns": ["plane", "TTFT"], "align": ["---", "---"],
                     "rows": [["tcp", "0.354 s"], ["ucx", "0.305 s"]]}
    assert second["rows"] == [["1"]]


def test_the_readme_ttft_row_finds_its_table_by_columns_in_a_run_of_bench_vllm(tmp_path):
    directory = _copy_of_the_records(tmp_path)
    imported = records.load(directory / "vllm" / "2026-12-05.json")
    ttft = next(t for t in imported["tables"] if "prefix (KV)" in t["columns"])
    records.write(directory, {"bench": "vllm", "date": "2099-01-02", "commit": "", "host": {}, "command": "",
                              "imported": "", "tables": [ttft], "notes": {},
                              "figures": _vllm_figures({"targets": [{"met": True}, {"met": False}]})})
    table = results_md(records.latest(directory), directory, tmp_path / "README.md")
    assert "recompute 3.5-3.7 s; **peer hit 0.30-0.35 s**; own-sidecar hit 0.19-0.23 s; 1 of 2 targets met |" in table


def _vllm_figures(report: dict) -> dict:
    figures = shape.spec("vllm").figures
    return {name: f(report) for name, f in figures.items()}


def test_bench_vllm_names_how_many_targets_were_met():
    assert _vllm_figures({"targets": [{"met": True}, {"met": False}, {"met": True}]}) == {
        "targets_met": "2 of 3 targets met"}


def test_a_bench_whose_json_flag_takes_a_path_is_recorded_with_its_report(fake_benches, capsys):
    out = fake_benches / "records"
    assert cli.main(["bench", "fakepath", "--record", str(out)]) == 0
    (path,) = records.record_paths(out, "fakepath")
    assert records.load(path)["report"] == {"rows": 3}
    assert capsys.readouterr().out == "a table\n"


def test_a_report_its_bench_cannot_convert_is_still_recorded_with_why(fake_benches, monkeypatch):
    def broken(bench, report):
        raise KeyError("bench fakejson: table 'T', column 'c', row 1: the report has no 'x'")
    monkeypatch.setattr("kv_offload_tools.bench_records.recorder.convert", broken)
    out = fake_benches / "records"
    assert cli.main(["bench", "fakejson", "--record", str(out)]) == 1
    (path,) = records.record_paths(out, "fakejson")
    r = records.load(path)
    assert r["report"] == {"size": 1} and r["tables"] == []
    assert r["notes"]["record"] == "no tables: bench fakejson: table 'T', column 'c', row 1: the report has no 'x'"


def test_bench_netns_shows_the_capped_holders_halves_and_each_churn_round():
    half = {"requests": 55, "hit_ratio": 1.0, "p50_ms": 3.7, "p99_ms": 476.7, "stalled": 0}
    report = {"capped": {"priced": {"first_half": half, "second_half": {**half, "p99_ms": None},
                                    "decisions": {"fetch": 8, "recompute": 86}, "max_link_failures": 7}},
              "churn": {"rounds": [{"round": 1, "departed_links_left": 0, "seconds_until_links_live": 4.02,
                                    "seconds_until_departed_forgotten": None, "seconds_until_rejoined": 5.49,
                                    "shared": [4, 0], "fds": {"a": 16, "b": 16}, "rss_mib": {"a": 103.1, "b": 103.0}}]}}
    capped, churn = convert("netns", report)["tables"]
    assert capped["rows"] == [["priced", "first", "55", "3.7", "476.7", "0", "8 / 86", "7"],
                              ["priced", "second", "55", "3.7", "-", "0", "", ""]]
    assert churn["rows"] == [["1", "0", "4.02 s", "-", "5.49 s", "4 read, 0 wrong", "16, 16", "103.1, 103.0"]]
    assert convert("netns", {"pods": 4})["tables"] == []  # scenarios not run: no table


def test_bench_netns_says_what_the_reused_resolver_and_domain_scenarios_showed_one_row_each():
    report = {"reused": {"member_refusals": {"pod-0": {"bad_proof": 0.0, "other_pool": 4.0}},
                         "other": "other-2-3", "other_pool_sidecar_refusals": {"bad_proof": 1.0, "other_pool": 7.0},
                         "seconds_from_unlisted_to_forgotten": 4.216},
              "resolver": {"seconds": 15.0, "seconds_until_all_failed": 9.93, "connected_before": 6,
                           "connected_during": 5, "shared_during": [4, 0]},
              "domain": {"name": "kvo.ns.svc", "resolved": "kvo.ns.svc.cluster.example", "shared": [3, 1]}}
    (others,) = convert("netns", report)["tables"]
    assert [row[1] for row in others["rows"]] == [
        "refusals pod-0 other_pool 4, bad_proof 0; other-2-3 other_pool 7, bad_proof 1; no member links to it "
        "4.22 s after the name stopped listing it",
        "all failed within 9.93 s; connected links 6 before, 5 during; a share meanwhile 4 read, 0 wrong",
        "resolved as kvo.ns.svc.cluster.example; a share 3 read, 1 wrong"]
    assert convert("netns", {"domain": report["domain"]})["tables"][0]["rows"] == [
        ["domain: pods of another cluster domain, found by kvo.ns.svc",
         "resolved as kvo.ns.svc.cluster.example; a share 3 read, 1 wrong"]]


def test_bench_netns_shows_the_isolated_pods_requests_what_the_pool_noticed_and_each_asymmetric_reader():
    def window(requests, ratio, p50, p99):
        return {"requests": requests, "hit_ratio": ratio, "wrong": 0, "p50_ms": p50, "p99_ms": p99}
    kind = {"before": window(40, 1.0, 3.9, 9.7), "during": window(100, 0.0, 1.4, 104.6),
            "after": window(101, 0.901, 4.1, 12.3), "added": {"p50_ms": -2.5, "p99_ms": 94.9}}
    report = {
        "isolate": {"victim": "pod-3", "victims_chunks": kind, "victims_reads": kind, "others": kind,
                    "timeline_s": {"cut_to_all_drop_it": 0.98, "stalled_requests": 0,
                                   "heal_to_all_connected": 1.3, "heal_to_first_whole_hit": None},
                    "half_open": {"end_of_cut": 3, "reconnected": 0, "end": 0}},
        "reconverged": "yes", "reconverged_after_idle": "no entries for pod-3",
        "idle": {"seconds": 15.0, "cut_to_all_drop_it": 0.95, "lookup_after_ms": 0.5},
        "asymmetric": {"readers": {"pod-0": {"before": window(13, 1.0, 3.9, 12.6),
                                             "during": window(33, 0.67, 4, 61.2)}},
                       "members_seen": {"pod-0": 3}, "unreachable_peers": {"pod-0": 1.0},
                       "connected_views": {"pod-0": ["pod-2", "pod-3"]}},
    }
    shown = convert("netns", report)
    requests, noticed, readers = shown["tables"]
    assert requests["rows"][:4] == [["for pod-3's chunks", "before", "40", "1.00", "3.9", "9.7"],
                                    ["for pod-3's chunks", "during", "100", "0.00", "1.4", "104.6"],
                                    ["for pod-3's chunks", "after", "101", "0.90", "4.1", "12.3"],
                                    ["for pod-3's chunks", "added", "", "", "-2.5", "+94.9"]]
    assert [r[0] for r in requests["rows"][4::4]] == ["pod-3's own reads", "everyone else's"]
    assert dict(noticed["rows"])["heal -> everyone connected / first whole hit (target <= 5 s)"] == "1.30 s / -"
    assert dict(noticed["rows"])["chunk directory current again after the heal / after the idle cut"] == (
        "yes / no entries for pod-3")
    assert readers["rows"] == [["pod-0", "1.00", "0.67", "61.2", "3", "1", "pod-2, pod-3"]]
    assert shown["figures"] == {"added_p99_ms": "+94.9 ms", "stalled_requests": "0", "cut_to_all_drop_it": "0.98 s",
                                "idle_noticed": "0.95 s", "idle_lookup_ms": "0.5 ms", "heal_to_all_connected": "1.30 s"}
    assert convert("netns", {"pods": 4})["figures"] == {}  # isolate not run: not measured


def test_bench_chaos_shows_a_fault_run_or_a_fuzz_run_and_names_its_invariants():
    fault = {"fault": "write_flood_10x", "injected": 40, "in_flight": 0, "survived": 40, "loads": 40,
             "loads_missed": 0, "corrupt_delivered": 0, "lost": 0, "integrity_rejected": 0,
             "worst_give_up_seconds": 0.0, "store_peak_bytes": 8 << 20, "store_budget_bytes": 8 << 20}
    faults = convert("chaos", {"faults": [fault], "late_writer": []})
    assert faults["tables"][0]["rows"] == [["write_flood_10x", "40", "0", "40", "40", "0", "0", "0", "0", "0.000",
                                            "8.00 / 8.00 MiB"]]
    assert faults["figures"] == {"invariants": "0 corrupt chunks delivered, 0 lost"}
    target = {"target": "lookup", "cases": 1700, "answers": 307, "errors": 1393, "incomplete": 0, "failures": 0}
    fuzz = convert("chaos", {"targets": [target, {**target, "target": "local"}], "cases": 3400, "failures": 0,
                             "crashes": 0})
    (table,) = fuzz["tables"]
    assert table["rows"][-1] == ["**total**", "3400", "614", "2786", "0", "0"]
    assert fuzz["figures"] == {"fuzz": "3,400 cases: 0 failures, 0 crashes"}
