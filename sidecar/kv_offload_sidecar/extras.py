"""The optional parts of kv-offload and the pip extra that brings each.

``pip install kv-offload`` runs the sidecar on the tcp data plane and the ``kv-offload``
command's translate, fingerprint, diff, install-tier and admin-token. The ucx and nixl data
planes, the operator and the tools each need an extra (pyproject.toml); nothing imports an
optional module before its part is chosen, and choosing a part whose module is missing is a
usage error that names the extra (``require``; the command line turns a late
``ModuleNotFoundError`` of one of these modules into the same line, ``missing``).
"""

from __future__ import annotations

import importlib.util

# The NIXL wheel the nixl data plane is built and tested against. It is installed without its
# dependencies: its declared torch and numpy requirements serve GPU paths only.
NIXL_PACKAGE = "nixl-cu12==1.5.1"

# The tools' extra (kv_offload_tools itself is in a checkout only, never in the image).
TOOLS = ("tools", "pip install 'kv-offload[tools]' from a checkout")
_OPERATOR = ("operator", "pip install 'kv-offload[operator]'")
# The demo's extra (torch for the simulated engines' KV; the tools' extra includes it).
DEMO = ("demo", "pip install 'kv-offload[demo]' from a checkout")
# Optional top-level module -> (the extra that brings it, the command that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "ucxx": ("ucx", "pip install 'kv-offload[ucx]'"),
    "libucx": ("ucx", "pip install 'kv-offload[ucx]'"),
    "nixl_cu12": ("nixl", f"pip install --no-deps {NIXL_PACKAGE}"),
    "kopf": _OPERATOR,
    "kubernetes_asyncio": _OPERATOR,
    "torch": DEMO,
    "matplotlib": TOOLS,
    "hypothesis": TOOLS,
}


def installed(module: str) -> bool:
    """``module`` can be imported (found without importing it: ucxx loads UCX when imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(module: str, needed_by: str, part: tuple[str, str] | None = None) -> str:
    """The one line saying that ``needed_by`` needs ``module`` and how to install it (``part``:
    its extra and install command, when ``module`` is not one of ``EXTRAS``)."""
    extra, install = part or EXTRAS[module]
    return f"{needed_by} needs {module}, which is not installed (the {extra!r} extra): {install}"


def require(needed_by: str, *modules: str) -> None:
    """ValueError (``missing``'s line) unless every one of ``modules`` is installed."""
    for module in modules:
        if not installed(module):
            raise ValueError(missing(module, needed_by))
