"""What a ``bench gpu --record`` run's record shows: per model, recompute against the peer hit
with each lane count, per prompt length (``bench_records.tables.gpu``)."""

from __future__ import annotations

from kv_offload_tools.bench_records.shape import Figures
from kv_offload_tools.bench_records.tables import gpu

FIGURES = Figures(tables=(gpu,))
