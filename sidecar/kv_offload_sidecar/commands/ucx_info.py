"""`kv-offload ucx-info`: which UCX the sidecar loads, the transports it was built with, and memlock.

UCX is loaded exactly as ucxx loads it (``libucx.load_library()``): the
libraries of the ``libucx`` wheel, or, with
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true``, the first ``libucs.so`` /
``libuct.so`` / ``libucp.so`` on the loader's path (the image puts its own
UCX, built with verbs and rdmacm, in ``/opt/ucx/lib`` on ``LD_LIBRARY_PATH``).
UCX loads its transport modules (``libuct_<name>.so``) from ``UCX_MODULE_DIR``,
else the ``ucx/`` directory beside the ``libucs`` it runs from, so the
compiled-in transports are the ones built into ``libuct`` (self, tcp, posix,
sysv) plus those of the modules found there. ``ucx_info -d`` of the same
installation, when it ships one, adds the transports usable on this host and
their devices (an RDMA transport needs an RDMA device besides its module).
``RLIMIT_MEMLOCK`` is reported because registering memory for RDMA pins it.

``rdma_not_compiled_in`` is the sidecar's start check: UCX_TLS that names an RDMA
transport the loaded UCX was built without (the libucx wheel has no verbs) stops the
ucx sidecar with one line, so a pool never runs without RDMA while asking for it.

``--require rc,rdmacm`` exits 1 with one line when a transport is not compiled
in, ``--match-wheel`` when the loaded UCX is another release than the libucx
wheel ucxx was built with; UCX libraries loaded from two directories always
exit 1 (the image build runs it). Standard library only; Linux
(``/proc/self/maps``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kv_offload_sidecar.extras import missing as missing_extra
from kv_offload_sidecar.usage import UsageError

# Transports libuct has built in (no module needed).
BUILT_IN: tuple[str, ...] = ("self", "tcp", "posix", "sysv")
# Transport module (libuct_<module>.so) -> the transports it provides.
MODULE_TRANSPORTS: Mapping[str, tuple[str, ...]] = {
    "ib": ("rc_verbs", "ud_verbs"),
    "ib_mlx5": ("rc_mlx5", "dc_mlx5", "ud_mlx5"),
    "ib_efa": ("srd",),
    "rdmacm": ("rdmacm",),
    "cma": ("cma",),
    "knem": ("knem",),
    "xpmem": ("xpmem",),
    "cuda": ("cuda_copy", "cuda_ipc"),
    "cuda_gdrcopy": ("gdr_copy",),
    "rocm": ("rocm_copy", "rocm_ipc"),
}
# UCX_TLS aliases --require accepts -> the transports any one of which satisfies them.
ALIASES: Mapping[str, tuple[str, ...]] = {
    "rc": ("rc_verbs", "rc_mlx5"), "ud": ("ud_verbs", "ud_mlx5"), "dc": ("dc_mlx5",),
    "sm": ("posix", "sysv"), "shm": ("posix", "sysv"), "mm": ("posix", "sysv"),
    "cuda": ("cuda_copy",), "ib": ("rc_verbs", "rc_mlx5"),
}
# UCX_TLS names that ask for RDMA (verbs, mlx5, EFA or the rdmacm connection manager).
RDMA_NAMES = frozenset({"rc", "ud", "dc", "ib", "rdmacm", "rc_verbs", "ud_verbs", "rc_mlx5",
                        "dc_mlx5", "ud_mlx5", "srd"})
_LIB = re.compile(r"/libuc[mpst](_signal)?\.so[.0-9]*$")


@dataclass(frozen=True)
class UcxReport:
    """What ``kv-offload ucx-info`` prints."""

    # UCX version of the loaded libucp ("1.21.0").
    version: str
    # Directory of the loaded libucs (the wheel's lib, or /opt/ucx/lib in the image).
    library_dir: str
    # Every UCX library file mapped into this process (one installation, never two).
    loaded: tuple[str, ...]
    # Where UCX looks for transport modules (UCX_MODULE_DIR, else library_dir/ucx).
    module_dir: str
    # Transport modules found there, e.g. ("cma", "cuda", "ib", "rdmacm").
    modules: tuple[str, ...]
    # Transports compiled in: BUILT_IN plus those of the modules.
    transports: tuple[str, ...]
    # Transport -> devices usable on this host (ucx_info -d); None without a ucx_info.
    devices: dict[str, list[str]] | None = None
    # How UCX was configured (ucx_info -v), e.g. "--with-verbs --with-rdmacm ..."; "" when unknown.
    configured_with: str = ""
    # RLIMIT_MEMLOCK (soft, hard) in bytes; -1 means unlimited.
    memlock: tuple[int, int] = (0, 0)
    # Requested transports (--require) that are not compiled in.
    missing: tuple[str, ...] = field(default=())
    # Version of the libucx wheel (the UCX release ucxx was built with).
    wheel_version: str = ""


def load_ucx() -> tuple[ctypes.CDLL, str]:
    """Load UCX the way ucxx does; returns libucp and the libucx wheel's version.
    UsageError when the libucx wheel is absent."""
    try:
        import libucx
    except ImportError:
        raise UsageError(missing_extra("libucx", "kv-offload ucx-info")) from None
    libraries = libucx.load_library()
    ucp = libraries[-1]
    if ucp is None:
        raise UsageError("kv-offload ucx-info: libucx found no libucp.so; check LD_LIBRARY_PATH and "
                         "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY")
    return ucp, str(getattr(libucx, "__version__", ""))


def mapped_ucx_libraries(maps: str | None = None) -> tuple[str, ...]:
    """UCX library files mapped into this process (from /proc/self/maps)."""
    text = Path("/proc/self/maps").read_text() if maps is None else maps
    return tuple(sorted({line.split()[-1] for line in text.splitlines()
                         if len(line.split()) >= 6 and _LIB.search(line.split()[-1])}))


def modules_in(module_dir: str) -> tuple[str, ...]:
    """Transport module names (``libuct_<name>.so``) in ``module_dir``."""
    names = set()
    if os.path.isdir(module_dir):
        for entry in os.listdir(module_dir):
            match = re.fullmatch(r"libuct_(\w+)\.so(\.[0-9]+)*", entry)
            if match:
                names.add(match.group(1))
    return tuple(sorted(names))


def compiled_transports(modules: Sequence[str]) -> tuple[str, ...]:
    found = list(BUILT_IN)
    for module in modules:
        found += MODULE_TRANSPORTS.get(module, ())
    return tuple(sorted(set(found)))


def missing_transports(required: Sequence[str], transports: Sequence[str], modules: Sequence[str]) -> tuple[str, ...]:
    """The required names (transports, UCX_TLS aliases or module names) none of whose
    transports is compiled in."""
    have = set(transports)
    missing = []
    for name in required:
        options = ALIASES.get(name, (name,))
        if not have.intersection(options) and name not in modules:
            missing.append(name)
    return tuple(missing)


def rdma_not_compiled_in(tls: str) -> str | None:
    """Why ``UCX_TLS=tls`` cannot have the RDMA it names with the UCX ucxx loads, or None
    (no RDMA named, a "^" exclusion list, or every named RDMA transport compiled in)."""
    asked = [name for name in (n.strip() for n in tls.split(",")) if name in RDMA_NAMES]
    if not asked or tls.strip().startswith("^"):
        return None
    ucp, _ = load_ucx()
    libucs = next((p for p in mapped_ucx_libraries() if re.search(r"/libucs\.so", p)), "")
    module_dir = os.environ.get("UCX_MODULE_DIR") or os.path.join(os.path.dirname(libucs), "ucx")
    modules = modules_in(module_dir)
    missing = missing_transports(asked, compiled_transports(modules), modules)
    if not missing:
        return None
    return (f"UCX_TLS={tls!r} asks for {', '.join(missing)}, which the UCX this sidecar runs "
            f"({os.path.dirname(libucs) or 'unknown'}) was built without (transports: "
            f"{', '.join(compiled_transports(modules))}): build the image with a UCX source "
            f"(UCX_TARBALL, see docs/how-to/rdma.md) for RDMA, or pick transports it has with --ucx-tls "
            f"(e.g. tcp,sm,self)")


def parse_ucx_info_devices(text: str) -> dict[str, list[str]]:
    """``ucx_info -d`` output -> transport -> devices."""
    devices: dict[str, list[str]] = {}
    transport = None
    for line in text.splitlines():
        match = re.match(r"#\s+(Transport|Device):\s*(\S+)", line)
        if not match:
            continue
        if match.group(1) == "Transport":
            transport = match.group(2)
        elif transport is not None:
            found = devices.setdefault(transport, [])
            if match.group(2) not in found:
                found.append(match.group(2))
    return devices


def _ucx_info(library_dir: str, *args: str) -> str | None:
    """Output of the installation's own ``ucx_info`` (``<prefix>/bin`` beside ``<prefix>/lib``)."""
    binary = Path(library_dir).parent / "bin" / "ucx_info"
    if not binary.is_file():
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=library_dir, UCX_WARN_UNUSED_ENV_VARS="n")
    try:
        done = subprocess.run([str(binary), *args], check=False, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def report(required: Sequence[str] = ()) -> UcxReport:
    """Load UCX (as ucxx does) and describe it."""
    ucp, wheel_version = load_ucx()
    ucp.ucp_get_version_string.restype = ctypes.c_char_p
    version = (ucp.ucp_get_version_string() or b"").decode()
    loaded = mapped_ucx_libraries()
    libucs = next((p for p in loaded if re.search(r"/libucs\.so", p)), "")
    library_dir = os.path.dirname(libucs)
    module_dir = os.environ.get("UCX_MODULE_DIR") or os.path.join(library_dir, "ucx")
    modules = modules_in(module_dir)
    transports = compiled_transports(modules)
    listed = _ucx_info(library_dir, "-d")
    configured = _ucx_info(library_dir, "-v") or ""
    match = re.search(r"Configured with: (.*)", configured)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return UcxReport(version=version, library_dir=library_dir, loaded=loaded, module_dir=module_dir,
                     modules=modules, transports=transports,
                     devices=None if listed is None else parse_ucx_info_devices(listed),
                     configured_with=match.group(1).strip() if match else "",
                     memlock=(soft, hard), missing=missing_transports(required, transports, modules),
                     wheel_version=wheel_version)


def _bytes(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value} bytes"


def render(r: UcxReport) -> str:
    lines = [f"UCX {r.version} from {r.library_dir}",
             f"transport modules ({r.module_dir}): {', '.join(r.modules) or 'none'}",
             f"compiled-in transports: {', '.join(r.transports)}"]
    if r.configured_with:
        lines.append(f"configured with: {r.configured_with}")
    if r.devices is None:
        lines.append("usable here: unknown (this UCX ships no ucx_info)")
    else:
        usable = [f"{t} ({', '.join(d)})" for t, d in sorted(r.devices.items())]
        lines.append(f"usable here: {'; '.join(usable) or 'none'}")
    lines.append(f"memlock limit: {_bytes(r.memlock[0])} (hard {_bytes(r.memlock[1])}); RDMA pins the store, "
                 f"so it must cover spec.sidecar.capacityBytes")
    return "\n".join(lines)


def problems(r: UcxReport, *, match_wheel: bool) -> list[str]:
    """What makes this UCX unfit for the sidecar, one sentence each."""
    found = []
    directories = sorted({os.path.dirname(p) for p in r.loaded})
    if len(directories) > 1:
        found.append(f"UCX libraries are loaded from {len(directories)} directories ({', '.join(r.loaded)}): "
                     f"put one complete UCX installation first on LD_LIBRARY_PATH")
    if r.missing:
        found.append(f"UCX {r.version} from {r.library_dir} has no {', '.join(r.missing)} transport (compiled in: "
                     f"{', '.join(r.transports)}); use the image's UCX (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true, "
                     f"LD_LIBRARY_PATH=/opt/ucx/lib)")
    if match_wheel and r.wheel_version != r.version:
        found.append(f"UCX {r.version} from {r.library_dir} is not the release of the libucx wheel ucxx was built "
                     f"with ({r.wheel_version or 'unknown'}); build the same release (Dockerfile ARG UCX_VERSION)")
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--require", default="", metavar="T,...",
                        help="exit 1 unless these transports are compiled in, e.g. rc,rdmacm (UCX_TLS names, "
                             "aliases rc/ud/dc/sm, or module names)")
    parser.add_argument("--match-wheel", action="store_true",
                        help="exit 1 unless the loaded UCX is the libucx wheel's release (ucxx's ABI)")


def run(args: argparse.Namespace) -> int:
    required = [t.strip() for t in args.require.split(",") if t.strip()]
    r = report(required)
    print(json.dumps(asdict(r), indent=2) if args.json else render(r), flush=True)
    found = problems(r, match_wheel=args.match_wheel)
    for problem in found:
        print(f"kv-offload ucx-info: {problem}", file=sys.stderr)
    return 1 if found else 0
