# The one kv-offload image: `kv-offload operator` (kopf operator and webhook)
# and `kv-offload sidecar` (per-pod chunk store and UCX/TCP data plane).
# Build: docker build -t kv-offload:0.1.0 .
# The tools (sidecar/kv_offload_tools: demo, simulated engine, benches) and their
# extra (torch, matplotlib, hypothesis) are not in the image.

FROM python:3.11.14-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/kv-offload
COPY pyproject.toml README.md ./
COPY sidecar/kv_offload_sidecar/ sidecar/kv_offload_sidecar/
COPY operator/ operator/
# A regular (non-editable) install of the project and its runtime
# dependencies, ucxx-cu12 among them; no test extra.
RUN /opt/kv-offload/bin/pip install --no-cache-dir /src \
    && /opt/kv-offload/bin/python -c "import kv_offload_sidecar, kv_offload_operator, ucxx" \
    && ! /opt/kv-offload/bin/python -c "import kv_offload_tools" 2>/dev/null

FROM python:3.11.14-slim-bookworm
LABEL org.opencontainers.image.title="kv-offload" \
      org.opencontainers.image.description="Peer-to-peer sharing of vLLM's offloaded KV cache across Kubernetes pods" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kv-offload \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kv-offload
COPY --from=build /opt/kv-offload /opt/kv-offload
ENV PATH=/opt/kv-offload/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so Kubernetes can verify runAsNonRoot without a passwd lookup.
USER 10001:10001
WORKDIR /tmp
EXPOSE 5710 5810 8080 9443
ENTRYPOINT ["kv-offload"]
CMD ["--help"]
