"""Parse a real ``vllm serve`` command line into the settings kv-offload needs.

Accepts ``vllm serve MODEL ...``, ``python -m vllm.entrypoints.openai.api_server
--model M ...``, ``python -m vllm.entrypoints.cli.main serve MODEL ...`` or the
flags alone, as one shell string or an argv list, optionally preceded by
``NAME=value`` environment assignments (kept in ``env``). Both ``--flag value``
and ``--flag=value`` forms, vLLM's short flags (``-tp``, ``-pp``, ``-dp``,
``-dcp``, ``-pcp``, ``-q``, ...), underscores in flag names and ``--kv-transfer-config.KEY
value`` (or ``--hf-overrides.KEY value``) dotted overrides are understood. Flags kv-offload does not need are
skipped, with their value. Standard library only: the translator and the
operator's webhook (a pod's own DP ranks and ``PYTHONHASHSEED``) use it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable


class VllmArgsError(ValueError):
    """A vLLM argument that cannot be understood; the message names the flag."""


# vLLM's API server port where --port is not given (vllm serve's default).
VLLM_DEFAULT_PORT = 8000

@dataclass(frozen=True)
class VllmServeArgs:
    """The parts of a ``vllm serve`` invocation that shape the offloaded KV cache."""

    # Model argument exactly as given (positional MODEL or --model), e.g.
    # "meta-llama/Llama-3.1-8B-Instruct"; None when absent.
    model: str | None = None
    # --dtype: "auto" (the model's torch_dtype), "bfloat16", "float16", "half", "float32".
    dtype: str = "auto"
    # --kv-cache-dtype: "auto" (the model dtype), "bfloat16", "fp8", "fp8_e4m3", ...
    kv_cache_dtype: str = "auto"
    # --block-size: tokens per GPU KV block; None lets vLLM pick (16 on FlashAttention).
    block_size: int | None = None
    # -tp/--tensor-parallel-size, >= 1.
    tensor_parallel_size: int = 1
    # -pp/--pipeline-parallel-size, >= 1.
    pipeline_parallel_size: int = 1
    # -dp/--data-parallel-size: engines (DP ranks) in the whole deployment, >= 1.
    data_parallel_size: int = 1
    # -dpl/--data-parallel-size-local: DP ranks this pod runs; None = all of them.
    data_parallel_size_local: int | None = None
    # -dpr/--data-parallel-start-rank: global index of this pod's first DP rank.
    data_parallel_start_rank: int | None = None
    # -dpn/--data-parallel-rank: the single global DP rank this pod runs
    # (external load balancing); None when not given.
    data_parallel_rank: int | None = None
    # -dcp/--decode-context-parallel-size, >= 1.
    decode_context_parallel_size: int = 1
    # -pcp/--prefill-context-parallel-size, >= 1.
    prefill_context_parallel_size: int = 1
    # --kv-transfer-config as a JSON object (dotted overrides merged in); None when absent.
    kv_transfer_config: Mapping[str, Any] | None = None
    # --kv-offloading-size in GiB (float as vLLM parses it); None when absent.
    kv_offloading_size: float | None = None
    # --kv-offloading-backend: "native" (OffloadingConnector) or "lmcache".
    kv_offloading_backend: str = "native"
    # --prefix-caching-hash-algo, e.g. "sha256", "sha256_cbor", "xxhash"; None = vLLM default.
    prefix_caching_hash_algo: str | None = None
    # --enable-prefix-caching / --no-enable-prefix-caching; None = vLLM default (on).
    enable_prefix_caching: bool | None = None
    # --prefix-match-unit: finest prefix-hit granularity in tokens; None = derived.
    prefix_match_unit: int | None = None
    # --disable-hybrid-kv-cache-manager: one KV cache group for all attention layers.
    disable_hybrid_kv_cache_manager: bool = False
    # --distributed-executor-backend: "mp", "ray", "uni", "external_launcher"; None = vLLM picks.
    distributed_executor_backend: str | None = None
    # -n/--nnodes: nodes the deployment spans, >= 1.
    nnodes: int = 1
    # --kv-events-config as a JSON object; None when absent.
    kv_events_config: Mapping[str, Any] | None = None
    # -sc/--speculative-config as a JSON object (dotted overrides merged in), e.g.
    # {"method": "eagle3", "model": "...", "num_speculative_tokens": 3}; None when absent.
    speculative_config: Mapping[str, Any] | None = None
    # NAME=value assignments that preceded the command (e.g. VLLM_USE_V2_MODEL_RUNNER=0).
    env: Mapping[str, str] = field(default_factory=dict)
    # --revision: the weights' hub revision (branch, tag or commit); None = the default branch.
    revision: str | None = None
    # --code-revision: the hub revision of the model's remote code; None when not given.
    code_revision: str | None = None
    # -q/--quantization: the method asked for, e.g. "fp8"; None = the checkpoint's own, if any.
    quantization: str | None = None
    # --hf-overrides as a JSON object (dotted overrides merged in), e.g.
    # {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}; None when absent.
    hf_overrides: Mapping[str, Any] | None = None
    # --host: the address the API server binds; None = all addresses (vLLM's default).
    host: str | None = None
    # --port: the API server's port, vLLM's default 8000 (VLLM_DEFAULT_PORT).
    port: int = VLLM_DEFAULT_PORT

    def metrics_url(self) -> str:
        """vLLM's /metrics as a container of the same pod reaches it: the API server's
        ``--host`` (loopback where it binds every address) and ``--port``."""
        host = self.host if self.host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def pod_dp_indices(self) -> tuple[int, ...]:
        """Global data-parallel indices of the engines this pod runs.

        ``--data-parallel-rank N`` gives ``(N,)``; otherwise start_rank ..
        start_rank + size_local - 1; all of ``range(data_parallel_size)`` when no
        local size is given.
        """
        if self.data_parallel_rank is not None:
            return (self.data_parallel_rank,)
        start = self.data_parallel_start_rank or 0
        if self.data_parallel_size_local is None:
            return tuple(range(start, self.data_parallel_size))
        return tuple(range(start, start + self.data_parallel_size_local))


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise VllmArgsError(f"{flag} must be an integer, got {value!r}") from None


def _positive_int(flag: str, value: str) -> int:
    n = _int(flag, value)
    if n < 1:
        raise VllmArgsError(f"{flag} must be at least 1, got {n}")
    return n


def _non_negative_int(flag: str, value: str) -> int:
    n = _int(flag, value)
    if n < 0:
        raise VllmArgsError(f"{flag} must be 0 or more, got {n}")
    return n


def _float(flag: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise VllmArgsError(f"{flag} must be a number of GiB, got {value!r}") from None
    if not number > 0:
        raise VllmArgsError(f"{flag} must be greater than 0, got {value!r}")
    return number


def _json_object(flag: str, value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise VllmArgsError(f"{flag} is not valid JSON ({exc.msg} at char {exc.pos}): "
                            f"quote it as one shell word, e.g. {flag} '{{\"kv_connector\": ...}}'"
                            ) from None
    if not isinstance(parsed, dict):
        raise VllmArgsError(f"{flag} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _str(flag: str, value: str) -> str:
    return value


# Canonical long flag -> (field name, converter). Aliases map onto these.
_VALUE_FLAGS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "--model": ("model", _str),
    "--dtype": ("dtype", _str),
    "--kv-cache-dtype": ("kv_cache_dtype", _str),
    "--block-size": ("block_size", _positive_int),
    "--tensor-parallel-size": ("tensor_parallel_size", _positive_int),
    "--pipeline-parallel-size": ("pipeline_parallel_size", _positive_int),
    "--data-parallel-size": ("data_parallel_size", _positive_int),
    "--data-parallel-size-local": ("data_parallel_size_local", _non_negative_int),
    "--data-parallel-start-rank": ("data_parallel_start_rank", _non_negative_int),
    "--data-parallel-rank": ("data_parallel_rank", _non_negative_int),
    "--decode-context-parallel-size": ("decode_context_parallel_size", _positive_int),
    "--prefill-context-parallel-size": ("prefill_context_parallel_size", _positive_int),
    "--kv-transfer-config": ("kv_transfer_config", _json_object),
    "--kv-offloading-size": ("kv_offloading_size", _float),
    "--kv-offloading-backend": ("kv_offloading_backend", _str),
    "--prefix-caching-hash-algo": ("prefix_caching_hash_algo", _str),
    "--prefix-match-unit": ("prefix_match_unit", _positive_int),
    "--distributed-executor-backend": ("distributed_executor_backend", _str),
    "--nnodes": ("nnodes", _positive_int),
    "--kv-events-config": ("kv_events_config", _json_object),
    "--speculative-config": ("speculative_config", _json_object),
    "--revision": ("revision", _str),
    "--code-revision": ("code_revision", _str),
    "--quantization": ("quantization", _str),
    "--hf-overrides": ("hf_overrides", _json_object),
    "--host": ("host", _str),
    "--port": ("port", _positive_int),
}
# Flags whose JSON object takes ``--flag.key.path value`` overrides.
_DOTTED_JSON_FLAGS = ("--kv-transfer-config", "--kv-events-config", "--speculative-config",
                      "--hf-overrides")
# Boolean flags kv-offload reads: flag -> (field, value it sets).
_BOOL_FLAGS: dict[str, tuple[str, bool]] = {
    "--enable-prefix-caching": ("enable_prefix_caching", True),
    "--no-enable-prefix-caching": ("enable_prefix_caching", False),
    "--disable-hybrid-kv-cache-manager": ("disable_hybrid_kv_cache_manager", True),
    "--no-disable-hybrid-kv-cache-manager": ("disable_hybrid_kv_cache_manager", False),
}
_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local",
    "-dpr": "--data-parallel-start-rank",
    "-dpn": "--data-parallel-rank",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-n": "--nnodes",
    "-sc": "--speculative-config",
    "-q": "--quantization",
}
# Flags of `vllm serve` that take no value; any other unknown flag without
# `=` consumes the next word as its value when that word is not a flag.
_UNKNOWN_BOOLEAN_FLAGS = frozenset({
    "--trust-remote-code", "--enforce-eager", "--async-scheduling", "--headless",
    "--skip-tokenizer-init", "--use-tqdm-on-load", "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb", "--data-parallel-multi-port-external-lb",
    "--calculate-kv-scales", "--fully-sharded-loras", "--return-tokens-as-token-ids",
    "--enable-log-requests", "--enable-log-outputs", "--allow-deprecated-quantization",
    "--safetensors-load-strategy-lazy", "--api-server-only",
    "-ep", "-dph", "-dpe", "-dpm", "--help", "-h", "--version",
})
_BOOLEAN_PREFIXES = ("--enable-", "--disable-", "--no-")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d+)?$")
# -O3 / -O.mode=x: the compilation level with its value attached.
_ATTACHED_VALUE = re.compile(r"^-O[\d.]")
_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
_CLI_MODULES = ("vllm.entrypoints.cli.main", "vllm")


def _normalize_flag(flag: str) -> str:
    """vLLM accepts underscores in flag names: --tensor_parallel_size == --tensor-parallel-size."""
    if flag.startswith("--"):
        base, dot, path = flag[2:].partition(".")  # dotted keys keep their spelling
        return "--" + base.replace("_", "-") + dot + path
    return flag


def _is_flag(word: str) -> bool:
    return word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.match(word)


def _strip_launcher(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """Drop env assignments and the program (vllm serve / python -m ...)."""
    env: dict[str, str] = {}
    i = 0
    while i < len(words) and words[i] in ("env", "exec"):
        i += 1
    while i < len(words) and _ENV_ASSIGNMENT.match(words[i]):
        name, _, value = words[i].partition("=")
        env[name] = value
        i += 1
    while i < len(words) and words[i] in ("env", "exec"):
        i += 1
    rest = words[i:]
    if not rest:
        return rest, env
    program = os.path.basename(rest[0])
    if program == "vllm":
        rest = rest[1:]
        if rest and rest[0] == "serve":
            rest = rest[1:]
    elif program.startswith("python"):
        j = 1
        while j < len(rest) and rest[j] != "-m" and _is_flag(rest[j]):
            j += 1  # interpreter options such as -u
        if j + 1 < len(rest) and rest[j] == "-m":
            module = rest[j + 1]
            rest = rest[j + 2:]
            if module in _CLI_MODULES and rest and rest[0] == "serve":
                rest = rest[1:]
            elif module not in _SERVER_MODULES + _CLI_MODULES:
                raise VllmArgsError(
                    f"'python -m {module}' is not a vLLM server: give the "
                    "'vllm serve MODEL ...' command line or its flags")
        else:
            raise VllmArgsError(
                "a python command line must run vLLM with '-m vllm.entrypoints.openai.api_server'")
    elif rest[0] == "serve":
        rest = rest[1:]
    return rest, env


def _set_dotted(target: dict[str, Any], path: str, raw: str) -> None:
    """Apply ``--kv-transfer-config.a.b value``: JSON values when they parse, else strings."""
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    keys = path.split(".")
    node = target
    for key in keys[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[keys[-1]] = value


def parse_vllm_args(argv: Sequence[str] | str) -> VllmServeArgs:
    """Parse a vLLM server command line (a string or an argv list).

    Raises ``VllmArgsError`` (a ``ValueError``) naming the flag whose value is
    missing or malformed.
    """
    if isinstance(argv, str):
        try:
            words = shlex.split(argv)
        except ValueError as exc:
            raise VllmArgsError(f"cannot split the vLLM command line: {exc} "
                                "(check the quotes around --kv-transfer-config)") from None
    else:
        words = [str(w) for w in argv]
    words, env = _strip_launcher(words)

    values: dict[str, Any] = {}
    positional_model: str | None = None
    dotted: list[tuple[str, str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            continue
        if not _is_flag(word):
            if positional_model is None:
                positional_model = word
            continue
        name, has_inline, inline = word.partition("=")
        name = _ALIASES.get(name, _normalize_flag(name))
        base, dot, sub = name.partition(".")
        if name in _BOOL_FLAGS and not has_inline:
            field_name, flag_value = _BOOL_FLAGS[name]
            values[field_name] = flag_value
            continue
        takes_value = (name in _VALUE_FLAGS or (dot and base in _VALUE_FLAGS)
                       or (name not in _UNKNOWN_BOOLEAN_FLAGS
                           and not name.startswith(_BOOLEAN_PREFIXES)
                           and not _ATTACHED_VALUE.match(name)))
        if has_inline:
            value: str | None = inline
        elif takes_value and i < len(words) and not _is_flag(words[i]):
            value = words[i]
            i += 1
        else:
            value = None
        if dot and base in _DOTTED_JSON_FLAGS:
            if value is None:
                raise VllmArgsError(f"{word} needs a value, e.g. {name} VALUE")
            dotted.append((base, sub, value))
        elif name in _VALUE_FLAGS:
            if value is None:
                raise VllmArgsError(f"{name} needs a value")
            field_name, convert = _VALUE_FLAGS[name]
            values[field_name] = convert(name, value)
        elif name in _BOOL_FLAGS:  # --flag=true / --flag=false
            field_name, flag_value = _BOOL_FLAGS[name]
            truthy = (value or "").lower() in ("1", "true", "yes", "on")
            values[field_name] = flag_value if truthy else not flag_value
        # any other flag: not ours, its value (if any) was skipped

    for base, sub, raw in dotted:
        field_name = _VALUE_FLAGS[base][0]
        target = dict(values.get(field_name) or {})
        _set_dotted(target, sub, raw)
        values[field_name] = target
    if positional_model is not None:
        values["model"] = positional_model  # vllm serve: MODEL wins over --model
    values["env"] = env
    args = VllmServeArgs(**values)
    _check_data_parallel(args)
    return args


def _check_data_parallel(args: VllmServeArgs) -> None:
    dp = args.data_parallel_size
    if args.data_parallel_rank is not None and args.data_parallel_rank >= dp:
        raise VllmArgsError(
            f"--data-parallel-rank {args.data_parallel_rank} must be below "
            f"--data-parallel-size {dp}")
    start = args.data_parallel_start_rank or 0
    local = args.data_parallel_size_local
    if local is not None and start + local > dp:
        raise VllmArgsError(
            f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} "
            f"exceeds --data-parallel-size {dp}")
    if local is None and start >= dp:
        raise VllmArgsError(
            f"--data-parallel-start-rank {start} must be below --data-parallel-size {dp}")
