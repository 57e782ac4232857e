"""The pages under docs/reference/ are what ``kv_offload_tools.reference_docs`` generates from
the code and the chart's files: a flag, command, metric, pool field or chart value changed
without regenerating the pages fails here, naming the page and the command that fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kv_offload_tools import reference_docs

REGENERATE = "PYTHONPATH=sidecar:operator .venv/bin/python -m kv_offload_tools.reference_docs --write"


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return reference_docs.render()


def test_every_reference_page_equals_what_the_code_generates(rendered) -> None:
    assert reference_docs.stale(rendered=rendered) == [], f"run: {REGENERATE}"


def test_a_page_edited_by_hand_or_missing_is_reported(tmp_path: Path, rendered) -> None:
    reference_docs.write(tmp_path, rendered)
    assert reference_docs.stale(tmp_path, rendered) == []
    (tmp_path / "metrics.md").write_text(rendered["metrics.md"] + "| `made_up_total` |\n")
    (tmp_path / "crd.md").unlink()
    assert reference_docs.stale(tmp_path, rendered) == ["metrics.md", "crd.md"]


def test_the_pages_name_every_command_bench_metric_pool_field_and_chart_value(rendered) -> None:
    from kv_offload_operator.cli import BENCHES, COMMANDS

    assert all(f"## `kv-offload {name}`" in rendered["cli.md"] for name in COMMANDS)
    assert all(f"## `kv-offload bench {name}`" in rendered["cli.md"] for name in BENCHES)
    assert "`kv_offload_chunk_lookups_total` | counter | `result`: local_hit, miss, peer_hit" in rendered["metrics.md"]
    assert "| `spec.sidecar.capacityBytes` |" in rendered["crd.md"]
    assert "| `image.repository` | string | `kv-offload` |" in rendered["chart-values.md"]
    assert "## `kv-offload sidecar`" in rendered["settings.md"] and "| `--pool-key-file` FILE | required |" \
        in rendered["settings.md"]


def test_a_pool_field_added_to_the_crd_appears_on_regeneration(tmp_path: Path, monkeypatch) -> None:
    import yaml

    crd = yaml.safe_load(reference_docs.CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["sidecar"]["properties"]["newKnob"] = {
        "type": "integer", "default": 3, "description": "A knob added after the pages were written."}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    monkeypatch.setattr(reference_docs, "CRD", tmp_path / "crd.yaml")
    assert "| `spec.sidecar.newKnob` | integer | `3` | A knob added after the pages were written. |" \
        in reference_docs.crd_page()


def test_check_exits_one_naming_a_stale_page(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(reference_docs, "OUT", tmp_path)
    assert reference_docs.main(["--check"]) == 1
    assert "docs/reference/settings.md differs from the code" in capsys.readouterr().err
    assert reference_docs.main(["--write"]) == 0
    assert reference_docs.main(["--check"]) == 0
