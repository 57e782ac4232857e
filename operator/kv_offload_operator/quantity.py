"""Kubernetes resource quantities ("16Gi", "500M", "1.5Gi", 17179869184) as whole bytes.

Pure (standard library only). ``parse_bytes`` accepts what the API server
accepts for a memory quantity: an integer, or a decimal number with an
optional binary (Ki Mi Gi Ti Pi Ei), decimal (k M G T P E) or exponent
(``e9``) suffix; fractions of a byte round up, as the kubelet does.
``format_bytes`` gives the shortest exact quantity string back.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": Decimal("0.001")}
_QUANTITY = re.compile(r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
                       r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[kMGTPEm]|[eE][+-]?[0-9]+)?$")
# A quantity string as the CRD's CEL rule accepts it (no sign, no milli-bytes).
QUANTITY_PATTERN = "^[0-9]+([.][0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"


def parse_bytes(value: Any, field: str) -> int:
    """``value`` (an int or a quantity string) as whole bytes; ValueError naming ``field`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{field}={value!r}: give bytes as an integer or a Kubernetes quantity "
                         f"such as \"16Gi\" or \"500M\"")
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"{field}={value!r} is not a Kubernetes quantity: write bytes as an integer "
                         f"or with a suffix, e.g. \"16Gi\", \"500M\", \"1.5Gi\"")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"{field}={value!r} is not a number") from None
    suffix = match["suffix"] or ""
    if suffix[:1] in ("e", "E"):
        scaled = number * (Decimal(10) ** int(suffix[1:]))
    else:
        scaled = number * Decimal(_BINARY.get(suffix) or _DECIMAL[suffix])
    return int(scaled.to_integral_value(rounding=ROUND_CEILING))


def positive_bytes(value: Any, field: str) -> int:
    """``parse_bytes`` that also refuses zero and negative sizes."""
    size = parse_bytes(value, field)
    if size <= 0:
        raise ValueError(f"{field}={value!r}: set a positive size, e.g. \"16Gi\"")
    return size


def format_bytes(size: int) -> str:
    """The shortest exact quantity for ``size`` bytes: "16Gi", "1536Mi", "1000".

    Stays exact, so a sizeLimit or memory request written from it is the very number computed.
    """
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _BINARY[suffix]
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
