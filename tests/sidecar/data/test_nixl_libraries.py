"""NIXL's wheel bundles its libraries (UCX, libibverbs, libnl) under hash-suffixed names; a
module of it that links an rdma-core library by its plain name loads the system's copy
beside the bundled one, and two libnl-route copies crash the process at exit (SIGSEGV in
rtnl_tc_unregister). Its UCX EFA module is the one such module: the image removes it."""

from __future__ import annotations

import re
import struct
from pathlib import Path

from kv_offload_sidecar.data.nixl.runtime import NIXL_MODULE

REPO = Path(__file__).resolve().parents[3]
# Libraries rdma-core ships (Debian's libibverbs1, librdmacm1, ibverbs-providers, libnl).
RDMA_CORE = re.compile(r"^lib(ibverbs|rdmacm|mlx[45]|efa|nl-3|nl-route-3|ibmad|ibumad)\.so")


def needed(path: Path) -> list[str]:
    """DT_NEEDED entries of an ELF64 little-endian shared object."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, path
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    assert dynamic is not None, path
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + j) for j in range(0, dynamic[1], 16)]
    strtab_vaddr = next(v for tag, v in entries if tag == 5)
    strtab = next(off + strtab_vaddr - va for va, off, size in loads if va <= strtab_vaddr < va + size)
    return [data[strtab + v:data.index(b"\0", strtab + v)].decode() for tag, v in entries if tag == 1]


def ucx_modules() -> list[Path]:
    import importlib.util
    spec = importlib.util.find_spec(NIXL_MODULE)
    assert spec is not None and spec.origin is not None
    libs = Path(spec.origin).parent.parent / f"{NIXL_MODULE}.libs" / "ucx"
    found = sorted(libs.glob("libuct_*.so*"))
    assert found, f"no UCX modules under {libs}"
    return found


def test_only_nixls_ucx_efa_module_links_a_system_rdma_core_library():
    unbundled = {p.name.split(".so")[0]: [n for n in needed(p) if RDMA_CORE.match(n)] for p in ucx_modules()}
    assert {name: libs for name, libs in unbundled.items() if libs} == {"libuct_ib_efa": ["libefa.so.1"]}


def test_the_image_removes_that_module_where_it_installs_nixl():
    dockerfile = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (nixl_run,) = [line for line in dockerfile.splitlines() if "pip install" in line and "nixl-cu12==" in line]
    assert "/nixl_cu12.libs/ucx/libuct_ib_efa.so*" in nixl_run
