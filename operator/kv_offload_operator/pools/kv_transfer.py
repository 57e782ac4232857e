"""The ``--kv-transfer-config`` the kv-offload tier needs, added where a vLLM command line has none.

Opt-in per pool with ``spec.injectKVTransferConfig`` (``{}`` takes every
default): vLLM's ``OffloadingConnector`` with the ``TieringOffloadingSpec``,
a primary CPU tier of ``cpuBytesToUse`` bytes in /dev/shm, chunks of
``blockSize`` tokens, and the kv-offload tier as its secondary tier (the
configuration the README shows). Pure (no kopf, no I/O): the translator reads
``effective_argv`` (the pool's arguments as the pods will run them) and the
webhook applies ``container_injection`` to the vLLM container. A command
line that already has ``--kv-transfer-config`` is left as it is.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..quantity import positive_bytes
from ..translation.vllm_args import parse_vllm_args
from .pool_pod import SHELLS

FLAG = "--kv-transfer-config"
# The secondary tier vLLM loads from the copy the webhook puts on PYTHONPATH.
TIER_ENTRY: Mapping[str, str] = {"type": "KVOffloadSecondaryTier",
                                 "module_path": "kv_offload_sidecar.engine.vllm_tier"}
# vLLM's primary CPU tier per engine (cpu_bytes_to_use): a /dev/shm region of this size.
DEFAULT_CPU_BYTES = 8 << 30
# Tokens per offloaded chunk (kv_connector_extra_config.block_size), the README's value.
DEFAULT_BLOCK_SIZE_TOKENS = 64
_SHELL_OPERATORS = set("();<>|&`$")


@dataclass(frozen=True)
class InjectedConnector:
    """The connector settings of ``spec.injectKVTransferConfig``."""

    # vLLM's primary CPU tier per engine, bytes (cpuBytesToUse).
    cpu_bytes_to_use: int = DEFAULT_CPU_BYTES
    # Tokens per offloaded chunk (blockSize), a multiple of vLLM's --block-size.
    block_size: int = DEFAULT_BLOCK_SIZE_TOKENS

    def config(self) -> dict[str, Any]:
        """The ``--kv-transfer-config`` object."""
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "cpu_bytes_to_use": self.cpu_bytes_to_use,
                                              "block_size": self.block_size,
                                              "secondary_tiers": [dict(TIER_ENTRY)]}}

    def text(self) -> str:
        """The flag's value as compact JSON (sorted keys, so every pod gets the same bytes)."""
        return json.dumps(self.config(), sort_keys=True, separators=(",", ":"))


def injected_connector(spec: Mapping[str, Any]) -> InjectedConnector | None:
    """``spec.injectKVTransferConfig`` read and checked; None when the pool does not ask for it."""
    value = spec.get("injectKVTransferConfig")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"spec.injectKVTransferConfig={value!r} must be an object: {{}} for the defaults, "
                         f"or {{cpuBytesToUse: 8Gi, blockSize: 64}}")
    cpu = positive_bytes(value.get("cpuBytesToUse", DEFAULT_CPU_BYTES), "spec.injectKVTransferConfig.cpuBytesToUse")
    block = value.get("blockSize", DEFAULT_BLOCK_SIZE_TOKENS)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"spec.injectKVTransferConfig.blockSize={block!r}: give tokens per offloaded chunk as a "
                         f"positive multiple of vLLM's --block-size, e.g. 64")
    return InjectedConnector(cpu_bytes_to_use=cpu, block_size=block)


def needs_injection(argv: Sequence[str], connector: InjectedConnector | None, where: str) -> bool:
    """True when ``connector`` is set and ``argv`` has no connector of its own.

    ValueError (naming ``where``) for ``--kv-offloading-size`` without a
    ``--kv-transfer-config``: that shorthand configures a connector without the
    kv-offload tier, and adding ours beside it would configure two.
    """
    if connector is None:
        return False
    args = parse_vllm_args(list(argv))
    if args.kv_transfer_config is not None:
        return False
    if args.kv_offloading_size is not None:
        raise ValueError(f"{where} sets --kv-offloading-size, which configures vLLM's CPU offloading without the "
                         f"kv-offload tier, and spec.injectKVTransferConfig would add a second connector: remove "
                         f"--kv-offloading-size, or remove spec.injectKVTransferConfig and give "
                         f"--kv-transfer-config yourself")
    return True


def effective_argv(argv: Sequence[str], connector: InjectedConnector | None, where: str) -> list[str]:
    """``argv`` as the pool's pods run it: with our ``--kv-transfer-config`` when injected."""
    if needs_injection(argv, connector, where):
        assert connector is not None
        return [*argv, FLAG, connector.text()]
    return list(argv)


def container_injection(container: Mapping[str, Any], connector: InjectedConnector,
                        where: str) -> dict[str, list[str]]:
    """The ``command``/``args`` fields that add our flag to ``container`` (replace these keys).

    A ``sh -c`` script gets the flag appended when it is one simple command
    (line continuations allowed); a script with several commands, pipes,
    redirections or substitutions is refused (ValueError naming ``where``),
    since the flag's place in it cannot be known.
    """
    command = [str(a) for a in container.get("command") or []]
    args = [str(a) for a in container.get("args") or []]
    combined = command + args
    flag = [FLAG, connector.text()]
    if combined and combined[0] in SHELLS and "-c" in combined:
        at = combined.index("-c") + 1
        if at >= len(combined):
            raise ValueError(f"{where} runs '{combined[0]} -c' without a script")
        script = combined[at]
        if _compound(script):
            raise ValueError(f"{where} runs a shell script with several commands, so "
                             f"spec.injectKVTransferConfig cannot place {FLAG} in it: add {FLAG} to the vllm "
                             f"command in the script yourself, or run vllm through command/args")
        combined[at] = script.rstrip() + " " + " ".join(shlex.quote(a) for a in flag)
        if at < len(command):
            return {"command": combined[:len(command)]}
        return {"args": combined[len(command):]}
    return {"args": args + flag}


def _compound(script: str) -> bool:
    """True when a shell script is more than one simple command."""
    text = script.replace("\\\n", " ").strip()
    if "\n" in text:
        return True
    lexer = shlex.shlex(text, posix=True, punctuation_chars="();<>|&")
    try:
        tokens = list(lexer)
    except ValueError:
        return True
    return any(tok and set(tok) <= _SHELL_OPERATORS for tok in tokens) or "$(" in text or "`" in text
