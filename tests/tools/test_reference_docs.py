"""The pages under docs/reference/ are what ``kv_offload_tools.reference_docs`` generates from
the code and the chart's files: a flag, metric, pool field or chart value changed without
regenerating the pages fails here, naming the page and the command that fixes it."""

from __future__ import annotations

from pathlib import Path

from kv_offload_tools import reference_docs


def test_every_reference_page_equals_what_the_code_generates() -> None:
    assert reference_docs.stale() == [], (
        "run: PYTHONPATH=sidecar:operator python -m kv_offload_tools.reference_docs --write")


def test_a_page_edited_by_hand_or_missing_is_reported(tmp_path: Path) -> None:
    reference_docs.write(tmp_path)
    assert reference_docs.stale(tmp_path) == []
    (tmp_path / "metrics.md").write_text((tmp_path / "metrics.md").read_text() + "| `made_up_total` |\n")
    (tmp_path / "crd.md").unlink()
    assert reference_docs.stale(tmp_path) == ["metrics.md", "crd.md"]


def test_the_pages_name_every_command_bench_metric_pool_field_and_chart_value() -> None:
    from kv_offload_operator.cli import BENCHES, COMMANDS

    cli = reference_docs.cli_page()
    assert all(f"## `kv-offload {name}`" in cli for name in COMMANDS)
    assert all(f"## `kv-offload bench {name}`" in cli for name in BENCHES)
    assert "`kv_offload_chunk_lookups_total` | counter | `result`: local_hit, miss, peer_hit" in \
        reference_docs.metrics_page()
    assert "| `spec.sidecar.capacityBytes` |" in reference_docs.crd_page()
    assert "| `image.repository` | string | `kv-offload` |" in reference_docs.chart_values_page()


def test_check_exits_one_naming_a_stale_page(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(reference_docs, "OUT", tmp_path)
    assert reference_docs.main(["--check"]) == 1
    assert "docs/reference/settings.md differs from the code" in capsys.readouterr().err
    assert reference_docs.main(["--write"]) == 0
    assert reference_docs.main(["--check"]) == 0
