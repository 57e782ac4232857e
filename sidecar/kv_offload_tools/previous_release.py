"""The last release's sidecar, beside this one's: a recorded commit in a temporary git worktree.

``LAST_RELEASE`` is the commit of the release before this one (the wire window's N-1,
``kv_offload_sidecar.peers.wire_window.WIRE_OLDEST``); a release records its predecessor
here when it bumps the wire version. ``checked_out`` adds a detached worktree of that commit
(``git worktree add --detach``) in a temporary folder and removes it afterwards;
``launcher`` is a ``LocalPool`` launcher that runs the named members from that worktree
(``python -m kv_offload_operator.cli`` with ``PYTHONPATH`` on its ``sidecar/`` and
``operator/``) and every other member from this tree, with the same arguments: a pool of two
releases, as an operator's rollout makes one. ``flags_refused`` parses a sidecar command line
(this operator's, as its webhook injects it) with that release's parser: a pinned older image
must accept what a newer operator passes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from kv_offload_testing.local_pool import sidecar_command

# The last release: wire 2.1 (speaks exactly 2.1, states no range in its handshake).
LAST_RELEASE = "d0dde592645119d2cef7f160a595539e62e8c7f4"
# Its wire version, as its /v1/status states it.
LAST_RELEASE_WIRE = "2.1"


def repository_root() -> str:
    """The git work tree this module lies in."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "--show-toplevel"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


@contextlib.contextmanager
def checked_out(commit: str = LAST_RELEASE, repo: str | None = None) -> Iterator[str]:
    """A detached worktree of ``commit`` in a temporary folder (yielded); removed on exit."""
    repo = repo or repository_root()
    parent = tempfile.mkdtemp(prefix="kv-offload-release-")
    path = os.path.join(parent, commit[:12])
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", path, commit], check=True,
                   capture_output=True, text=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path],
                       capture_output=True, text=True)
        shutil.rmtree(parent, ignore_errors=True)  # (no prune: other worktrees share the repository)


def release_command(release_dir: str) -> list[str]:
    """argv prefix running ``kv-offload`` from a release's worktree with this interpreter."""
    path = os.pathsep.join(os.path.join(release_dir, d) for d in ("sidecar", "operator"))
    return ["env", f"PYTHONPATH={path}", sys.executable, "-m", "kv_offload_operator.cli"]


def launcher(release_dir: str, members: Collection[str]
             ) -> Callable[[Sequence[str], Mapping[str, str]], list[str]]:
    """A LocalPool launcher: the ``members`` (their ``--identity``) run the release in
    ``release_dir``, the others this tree's ``kv-offload``."""
    def launch(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
        identity = args[list(args).index("--identity") + 1]
        prefix = release_command(release_dir) if identity in members else sidecar_command()
        return [*prefix, *args]
    return launch


def flags_refused(release_dir: str, args: Sequence[str]) -> str | None:
    """The release's parser's complaint about ``args`` (``["sidecar", ...]``); None: accepted."""
    code = ("import sys\nfrom kv_offload_operator.cli import build_parser\n"
            "argv = sys.argv[1:]\nbuild_parser(argv).parse_args(argv)\n")
    out = subprocess.run([*release_command(release_dir)[:-2], "-c", code, *args],
                         capture_output=True, text=True, timeout=60)
    return None if out.returncode == 0 else (out.stderr.strip() or f"exit {out.returncode}")


__all__ = ["LAST_RELEASE", "LAST_RELEASE_WIRE", "checked_out", "flags_refused", "launcher",
           "release_command", "repository_root"]
