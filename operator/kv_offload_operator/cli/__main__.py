"""``python -m kv_offload_operator.cli``: the ``kv-offload`` command without its installed script
(a machine with the sources on PYTHONPATH only, e.g. a GPU host; LocalPool starts sidecars so
when no ``kv-offload`` script sits beside the interpreter)."""

import sys

from kv_offload_operator.cli import main

sys.exit(main())
