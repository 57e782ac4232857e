# The one kv-offload image: `kv-offload operator` (kopf operator and webhook)
# and `kv-offload sidecar` (per-pod chunk store and UCX/TCP data plane).
# Build: docker build -t kv-offload:0.1.0 .
# The tools (sidecar/kv_offload_tools: demo, simulated engine, benches) and their
# extra (torch, matplotlib, hypothesis) are not in the image.

# UCX release the sidecar runs: the version of the libucx-cu12 wheel that ucxx
# loads (pinned below, so ucxx and this UCX share one ABI).
ARG UCX_VERSION=1.21.0

# UCX with InfiniBand/RoCE transports. The libucx-cu12 wheel is configured
# --without-verbs --without-rdmacm (sm, tcp, cma and cuda only: UCX_TLS=rc
# answers "transport 'rc' is not available"). This stage builds the same UCX
# release from the upstream tarball (github.com/openucx/ucx releases), checked
# against its SHA-256, with verbs and rdmacm (and mlx5 where rdma-core has it)
# against Debian's rdma-core, and with the wheel's other options but CUDA (the
# sidecar moves host memory). Nothing of the build tools reaches the image.
FROM python:3.11.14-slim-bookworm AS ucx
ARG UCX_VERSION
ARG UCX_SHA256=2374d2fcf3186fbfd5e27633ab153aabaeb6b4f503a88563d2aca67cf51ed2c1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       build-essential=12.9 libibverbs-dev=44.0-2 librdmacm-dev=44.0-2 libnuma-dev=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /build
RUN python -c "import urllib.request, sys; urllib.request.urlretrieve(sys.argv[1], 'ucx.tar.gz')" \
       "https://github.com/openucx/ucx/releases/download/v${UCX_VERSION}/ucx-${UCX_VERSION}.tar.gz" \
    && echo "${UCX_SHA256}  ucx.tar.gz" | sha256sum --check --strict \
    && tar -xzf ucx.tar.gz
WORKDIR /build/ucx-${UCX_VERSION}
RUN ./configure --prefix=/opt/ucx --disable-logging --disable-debug --disable-assertions \
       --disable-params-check --enable-mt --enable-cma --enable-numa --without-cuda \
       --with-verbs --with-rdmacm \
    && make -j"$(nproc)" \
    && make install \
    && test -e /opt/ucx/lib/ucx/libuct_ib.so && test -e /opt/ucx/lib/ucx/libuct_rdmacm.so \
    && rm -rf /opt/ucx/lib/*.a /opt/ucx/lib/*.la /opt/ucx/lib/ucx/*.a /opt/ucx/lib/ucx/*.la \
       /opt/ucx/share/ucx/examples /opt/ucx/include

FROM python:3.11.14-slim-bookworm AS build
ARG UCX_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/kv-offload
COPY pyproject.toml README.md ./
COPY sidecar/kv_offload_sidecar/ sidecar/kv_offload_sidecar/
COPY operator/ operator/
# A regular (non-editable) install of the project and its runtime
# dependencies, ucxx-cu12 among them, with the libucx wheel of the UCX
# release built above; no test extra.
RUN /opt/kv-offload/bin/pip install --no-cache-dir /src "libucx-cu12==${UCX_VERSION}" \
    && /opt/kv-offload/bin/python -c "import kv_offload_sidecar, kv_offload_operator, ucxx" \
    && ! /opt/kv-offload/bin/python -c "import kv_offload_tools" 2>/dev/null
# NVIDIA NIXL for --transport nixl (one-sided reads), pinned and installed without its
# dependencies as ./dev does: its declared requirements serve GPU paths only. Its kernels
# for GPU expert parallelism and its C headers are never imported here.
RUN /opt/kv-offload/bin/pip install --no-cache-dir --no-deps "nixl-cu12==1.5.1" \
    && rm -rf /opt/kv-offload/lib/python3.11/site-packages/nixl_ep_cu12 \
       /opt/kv-offload/include/site/python3.11/nixl-cu12 \
    && /opt/kv-offload/bin/python -c "import nixl_cu12"

FROM python:3.11.14-slim-bookworm
LABEL org.opencontainers.image.title="kv-offload" \
      org.opencontainers.image.description="Peer-to-peer sharing of vLLM's offloaded KV cache across Kubernetes pods" \
      org.opencontainers.image.licenses="Apache-2.0"
# rdma-core's user-space verbs, rdmacm and NIC provider libraries (mlx5, efa,
# ...) for the UCX of /opt/ucx; the NIC and its kernel driver come from the node.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       libibverbs1=44.0-2 librdmacm1=44.0-2 ibverbs-providers=44.0-2 libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kv-offload \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kv-offload
COPY --from=ucx /opt/ucx /opt/ucx
COPY --from=build /opt/kv-offload /opt/kv-offload
# ucxx loads UCX through the libucx wheel's loader, which with
# RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true takes libucs/libuct/libucp from the
# loader path before its own copies; UCX then loads its transport modules from
# /opt/ucx/lib/ucx, beside the libucs it runs from.
ENV PATH=/opt/kv-offload/bin:$PATH \
    LD_LIBRARY_PATH=/opt/ucx/lib \
    RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The sidecar's UCX is /opt/ucx with RDMA compiled in, the same release as the wheel.
RUN kv-offload ucx-info --require rc,ud,rdmacm,tcp,sm --match-wheel
# Numeric, so Kubernetes can verify runAsNonRoot without a passwd lookup.
USER 10001:10001
WORKDIR /tmp
EXPOSE 5710 5810 8080 9443
ENTRYPOINT ["kv-offload"]
CMD ["--help"]
