"""What a ``bench transport --record`` run's record shows: GB/s, ratio to raw TCP and CPU per
GB of each method and chunk size (``bench_records.tables.transport``)."""

from __future__ import annotations

from kv_offload_tools.bench_records.shape import Figures
from kv_offload_tools.bench_records.tables import transport

FIGURES = Figures(tables=(transport,))
