# The one kv-offload image: `kv-offload operator` (kopf operator and webhook)
# and `kv-offload sidecar` (per-pod chunk store and UCX/TCP/NIXL data plane).
# Build: ./dev image (daemonless, smoke-tested), or docker build -t kv-offload:0.1.0 .
# (the chart's default image is kv-offload:<appVersion>). The tools
# (sidecar/kv_offload_tools: demo, benches; sidecar/kv_offload_testing: local pool, simulated engine) and their extra
# (torch, matplotlib, hypothesis) are not in the image. docs/how-to/build-the-image.md: what is in it.

# The Python base of every stage. Any Debian bookworm image with python3 (3.11) and
# python3-venv serves: ./dev image makes one with mmdebstrap when no registry answers.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm
# UCX release the sidecar runs: the version of the libucx-cu12 wheel that ucxx
# loads (pinned below, so ucxx and this UCX share one ABI).
ARG UCX_VERSION=1.21.0
# The UCX release tarball to build with InfiniBand/RoCE transports, as a path in the
# build context (ucx-1.21.0.tar.gz from github.com/openucx/ucx/releases, checked
# against UCX_SHA256). Empty: no UCX is built and the sidecar runs the libucx wheel's
# UCX (tcp, sm and cma; no verbs, no rdmacm: no RDMA); the image's labels
# io.kv-offload.ucx (the tarball, or "the libucx-cu12 wheel: no RDMA") and
# io.kv-offload.ucx-transports, and `kv-offload ucx-info`, say which one it has.
ARG UCX_TARBALL=""

# UCX with InfiniBand/RoCE transports. The libucx-cu12 wheel is configured
# --without-verbs --without-rdmacm (sm, tcp, cma and cuda only: UCX_TLS=rc
# answers "transport 'rc' is not available"). With UCX_TARBALL this stage builds
# the same UCX release from that tarball, checked against its SHA-256, with verbs
# and rdmacm (and mlx5 where rdma-core has it) against Debian's rdma-core, and with
# the wheel's other options but CUDA (the sidecar moves host memory); a tarball
# that builds no ib or rdmacm module fails the build. Nothing of the build tools
# reaches the image. Without UCX_TARBALL it leaves /opt/ucx empty.
FROM ${BASE_IMAGE} AS ucx
ARG UCX_VERSION
ARG UCX_TARBALL
ARG UCX_SHA256=2374d2fcf3186fbfd5e27633ab153aabaeb6b4f503a88563d2aca67cf51ed2c1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /build
RUN --mount=type=bind,target=/context \
    mkdir -p /opt/ucx/lib \
    && if [ -z "${UCX_TARBALL}" ]; then exit 0; fi \
    && echo "${UCX_SHA256}  /context/${UCX_TARBALL}" | sha256sum --check --strict \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
       build-essential=12.9 libibverbs-dev=44.0-2 librdmacm-dev=44.0-2 libnuma-dev=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/* \
    && tar -xzf "/context/${UCX_TARBALL}" \
    && "ucx-${UCX_VERSION}/configure" --prefix=/opt/ucx --disable-logging --disable-debug \
       --disable-assertions --disable-params-check --enable-mt --enable-cma --enable-numa \
       --without-cuda --with-verbs --with-rdmacm \
    && make -j"$(nproc)" \
    && make install \
    && test -e /opt/ucx/lib/ucx/libuct_ib.so && test -e /opt/ucx/lib/ucx/libuct_rdmacm.so \
    && rm -rf /opt/ucx/lib/*.a /opt/ucx/lib/*.la /opt/ucx/lib/ucx/*.a /opt/ucx/lib/ucx/*.la \
       /opt/ucx/share/ucx/examples /opt/ucx/include /build

FROM ${BASE_IMAGE} AS build
ARG UCX_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python3 -m venv /opt/kv-offload
COPY pyproject.toml README.md ./
COPY sidecar/kv_offload_sidecar/ sidecar/kv_offload_sidecar/
COPY operator/kv_offload_operator/ operator/kv_offload_operator/
# A regular (non-editable) install of the project with what a pod runs: the ucx data plane
# (extra ucx: ucxx-cu12, with the libucx wheel of the UCX release built above) and the
# operator (extra operator: kopf, kubernetes-asyncio); no tools or test extra. Where the network intercepts TLS, the build is given
# the host's CA bundle as the secret pip-ca (./dev image does): pip trusts it for these
# steps only, and nothing of it stays in the image.
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && /opt/kv-offload/bin/pip install --no-cache-dir "/src[ucx,operator]" "libucx-cu12==${UCX_VERSION}" \
    && /opt/kv-offload/bin/python -c "import kv_offload_sidecar, kv_offload_operator, ucxx, kopf" \
    && ! /opt/kv-offload/bin/python -c "import kv_offload_tools" 2>/dev/null \
    && ! /opt/kv-offload/bin/python -c "import kv_offload_testing" 2>/dev/null
# NVIDIA NIXL for --transport nixl (one-sided reads), pinned and installed without its
# dependencies as ./dev does: its declared requirements serve GPU paths only. Its kernels
# for GPU expert parallelism and its C headers are never imported here. Its bundled UCX's
# EFA module goes too: it is the one library of the wheel that links a system library
# rdma-core provides (libefa.so.1, not bundled), so where Debian's rdma-core is installed
# it loads Debian's libefa, libibverbs, libnl-3 and libnl-route-3 beside NIXL's bundled
# copies; the second libnl-route's destructor then runs rtnl_tc_unregister against the
# first's tables at exit, and every nixl sidecar died with SIGSEGV (exit 139) after a
# clean stop. Without the module each library is loaded once (EFA devices are AWS's; NIXL's
# mlx5 and verbs modules use its bundled rdma-core).
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && /opt/kv-offload/bin/pip install --no-cache-dir --no-deps "nixl-cu12==1.5.1" \
    && rm -rf /opt/kv-offload/lib/python3.11/site-packages/nixl_ep_cu12 \
       /opt/kv-offload/include/site/python3.11/nixl-cu12 \
       /opt/kv-offload/lib/python3.11/site-packages/nixl_cu12.libs/ucx/libuct_ib_efa.so* \
    && /opt/kv-offload/bin/python -c "import nixl_cu12"

FROM ${BASE_IMAGE}
ARG UCX_VERSION
ARG UCX_TARBALL
LABEL org.opencontainers.image.title="kv-offload" \
      org.opencontainers.image.description="Peer-to-peer sharing of vLLM's offloaded KV cache across Kubernetes pods" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.kv-offload.ucx-version="${UCX_VERSION}" \
      io.kv-offload.ucx="${UCX_TARBALL:-the libucx-cu12 wheel: no RDMA}" \
      io.kv-offload.ucx-transports="${UCX_TARBALL:+rc, ud, dc, rdmacm, }tcp, sm, cma"
# rdma-core's user-space verbs, rdmacm and NIC provider libraries (mlx5, efa,
# ...) for the UCX of /opt/ucx, only when it was built (UCX_TARBALL): nothing else in
# the image links them (NIXL bundles its own). The NIC and its kernel driver come from
# the node.
RUN if [ -n "${UCX_TARBALL}" ]; then \
       apt-get update \
       && apt-get install -y --no-install-recommends \
          libibverbs1=44.0-2 librdmacm1=44.0-2 ibverbs-providers=44.0-2 libnuma1=2.0.16-1 \
       && rm -rf /var/lib/apt/lists/*; \
    fi \
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
# Which UCX the sidecar runs, checked: with UCX_TARBALL, /opt/ucx with verbs and rdmacm
# compiled in (the build fails without them); else the libucx wheel's (no RDMA), as the
# label says. Either way the release of the wheel ucxx was built against.
RUN kv-offload ucx-info --require "${UCX_TARBALL:+rc,ud,rdmacm,}tcp,sm" --match-wheel
# Numeric, so Kubernetes can verify runAsNonRoot without a passwd lookup.
USER 10001:10001
WORKDIR /tmp
EXPOSE 5710 5810 8080 9443
ENTRYPOINT ["kv-offload"]
CMD ["--help"]
