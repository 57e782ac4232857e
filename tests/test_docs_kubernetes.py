"""docs/tutorials/cluster.md is the one install walk: a walk a user can type: the chart renders with exactly its values
file and `helm install` line (the image it built and pushed, the monitoring it turns on),
and its pool and Deployment pass the CRD's schema and the operator's own parsing."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "tutorials" / "cluster.md"
CHART = REPO / "charts" / "kv-offload"
LLAMA_CONFIG = REPO / "tests" / "operator" / "fixtures" / "llama-3.1-8b.json"


def shell_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.S | re.M)


def heredocs(command_prefix: str) -> list[str]:
    """The bodies of the `<<'EOF'` here-documents of commands starting with ``command_prefix``."""
    found = []
    for block in shell_blocks():
        for m in re.finditer(r"^([^\n]*?)<<'EOF'\n(.*?)^EOF$", block, re.S | re.M):
            if m.group(1).strip().startswith(command_prefix):
                found.append(m.group(2))
    return found


def command(prefix: str) -> list[str]:
    """The one command line starting with ``prefix``, continuation lines joined, as argv."""
    lines = [line for block in shell_blocks() for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    (line,) = [line for line in lines if line.startswith(prefix)]
    return shlex.split(line.split(" #", 1)[0])


def image_pushed() -> str:
    """The image reference step 2 pushes (`buildah push ... docker://<ref>`)."""
    return command("buildah push")[-1].removeprefix("docker://")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("walk")
    (values,) = heredocs("cat > kv-offload-values.yaml")
    (tmp / "kv-offload-values.yaml").write_text(values)
    argv = command("helm install kv-offload charts/kv-offload")
    assert argv[:2] == ["helm", "install"]
    helm = Path(sys.executable).parent / "helm"
    # run where the user stands (the checkout), the values file where step 3 wrote it
    args = [str(tmp / a) if a == "kv-offload-values.yaml" else a for a in argv[2:]]
    proc = subprocess.run([str(helm), "template", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def objects(rendered: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in rendered if o["kind"] == kind]


def test_the_walk_installs_the_image_it_built_and_pushed(rendered):
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert image_pushed() == f"registry.example.com/team/kv-offload:{app_version}"
    built = command("buildah push")[-2]
    assert built == f"localhost/kv-offload:{app_version}"  # what ./dev image tags
    (deployment,) = objects(rendered, "Deployment")
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert images == {image_pushed()}
    assert deployment["metadata"]["namespace"] == command("helm install kv-offload")[
        command("helm install kv-offload").index("--namespace") + 1]


def test_the_walk_turns_on_scraping_alerts_and_the_hit_rate_dashboard(rendered):
    assert {"PodMonitor", "ServiceMonitor", "PrometheusRule"} <= {o["kind"] for o in rendered}
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        (obj,) = objects(rendered, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboards = [o for o in objects(rendered, "ConfigMap")
                  if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert dashboards and all(o["metadata"]["namespace"] == "monitoring" for o in dashboards)
    (board,) = [json.loads(v) for o in dashboards for v in o["data"].values()]
    assert board["title"] in DOC.read_text()  # the dashboard the walk tells the user to open
    assert "hit" in board["panels"][0]["title"].lower()


def test_the_walks_pool_and_deployment_pass_the_crd_and_the_operator(tmp_path):
    from kv_offload_operator.pools import kv_transfer
    from kv_offload_operator.pools.pool_source import template_source, workload_ref
    from kv_offload_operator.pools.pool_spec import SidecarSpec
    from kv_offload_operator.translation.translate import translate

    manifests = [yaml.safe_load(body) for body in heredocs("kubectl -n inference apply -f -")]
    (pool,) = [m for m in manifests if m["kind"] == "KVOffloadPool"]
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment"]
    crd = yaml.safe_load((CHART / "files" / "crd-kvoffloadpools.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == pool["apiVersion"].split("/")[1]]
    jsonschema.validate(pool, version["schema"]["openAPIV3Schema"])
    SidecarSpec.from_pool(pool, default_image=image_pushed())
    _, kind, name = workload_ref(pool["spec"])
    assert (kind, name) == (deployment["kind"], deployment["metadata"]["name"])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["kv-offload.io/pool"] == pool["metadata"]["name"]
    source = template_source(kind, name, deployment)
    # the pool asks for the --kv-transfer-config: translated as the operator does (pool_source.vllm_source)
    argv = kv_transfer.effective_argv(source.argv, kv_transfer.injected_connector(pool["spec"]), source.where)
    assert kv_transfer.FLAG in argv and kv_transfer.FLAG not in source.argv
    config = translate(argv, json.loads(LLAMA_CONFIG.read_text()), env=source.env)
    assert re.fullmatch(r"[0-9a-f]{16}", config.fingerprint)
    # the label patch for an existing Deployment puts the same label on the pod template
    patch = json.loads(command("kubectl -n inference patch deployment")[-1])
    assert patch["spec"]["template"]["metadata"]["labels"] == {"kv-offload.io/pool": pool["metadata"]["name"]}
