# syntax=docker/dockerfile:1
# The spanvisor image: `spanvisor run` as a non-root user, state under /var/lib/spanvisor.
#
#   docker build -t registry.example.com/spanvisor:0.2.0 .
#   docker push registry.example.com/spanvisor:0.2.0
#   docker build --build-arg EXTRAS=fleet,llm ...   # more of pyproject's extras
#
# Everything listens on 127.0.0.1 unless told otherwise (the settings' defaults): right
# for a sidecar, whose agent shares the pod's (or `docker run --network
# container:AGENT`'s) network namespace and reaches it on loopback. A port published
# with `docker run -p` reaches nothing on loopback; to listen beyond it, set
# SPANVISOR_HOST=0.0.0.0 with SPANVISOR_OTLP_TOKEN (16+ characters), else spanvisor
# refuses to start (docs/operations.md, "Container image").
#
# Settings: SPANVISOR_* variables, or a settings file mounted anywhere and named by
# SPANVISOR_CONFIG (the healthcheck and `docker exec ... spanvisor incidents` read that
# variable too, where a --config flag would be seen by `run` alone). No flag is baked
# into CMD: a flag wins over a SPANVISOR_* variable, so one here would silently
# override `docker run -e SPANVISOR_HOST=...`.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps the rest out of the context).
COPY pyproject.toml README.md ./
COPY supervisor ./supervisor
COPY policies ./policies
COPY remediators ./remediators
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
# Redis-shared breakers; Postgres (remediation_database_url) needs nothing more:
# DBOS's psycopg[binary] carries its own libpq.
ARG EXTRAS=fleet
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/spanvisor
COPY --from=build /wheels /wheels
RUN wheel="$(echo /wheels/spanvisor-*.whl)" \
    && python -m pip install --no-cache-dir "${wheel}[${EXTRAS}]" \
    && rm -rf /wheels

# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it. HOME is the state
# directory: the defaults (~/.spanvisor/state.db, ~/.spanvisor/api-token) land there, on
# the volume to mount at /var/lib/spanvisor, and the CLI run with `docker exec` finds
# the token file the sidecar wrote.
RUN groupadd --system --gid 10001 spanvisor \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/spanvisor \
       --create-home --shell /usr/sbin/nologin spanvisor
WORKDIR /var/lib/spanvisor
USER 10001:10001

# OTLP/gRPC, OTLP/HTTP, control API (otlp_grpc_port, otlp_http_port, api_port).
EXPOSE 4317 4318 4320

# /healthz needs no token; the address is found as the CLI finds it (SPANVISOR_API_URL,
# SPANVISOR_API_PORT, the file SPANVISOR_CONFIG names), so a moved port is followed.
# Kubernetes ignores HEALTHCHECK: its manifests probe the same way (config/).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request as r; from supervisor.api_access import resolve_access; r.urlopen(resolve_access().url + '/healthz', timeout=3)"]

# SIGTERM drains (drain_timeout_s) and exits 0; give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["spanvisor"]
CMD ["run"]
