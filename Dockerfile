# syntax=docker/dockerfile:1
#
# The outbox relay as a sidecar image: `outbox-relay run` delivers the outbox, and the same
# image runs `outbox-relay migrate` as an init step (its migrations are in the outbox package).
#
#   docker pull python:3.11-slim
#   docker build -t sqlalchemy-outbox-relay \
#     --build-arg PYTHON_IMAGE=$(docker inspect --format '{{index .RepoDigests 0}}' python:3.11-slim) .
#   docker run --rm -e OUTBOX_DATABASE_URL=... sqlalchemy-outbox-relay migrate   # init step
#   docker run -e OUTBOX_DATABASE_URL=... -e AWS_REGION=... sqlalchemy-outbox-relay   # the relay
#
# Configuration comes only from the environment; every flag of `outbox-relay run` has an
# OUTBOX_* variable (`docker run --rm IMAGE run --help` lists them all):
#
#   OUTBOX_DATABASE_URL     required. SQLAlchemy URL, e.g. postgresql+psycopg://relay:pw@db/shop
#                           or mysql+pymysql://relay:pw@db/shop (drivers for both are installed).
#                           Give the relay its least-privilege role (examples/deploy/grants-*.sql)
#                           and `migrate` the schema owner's URL.
#   OUTBOX_SENDER           ses (set below), smtp, console, or package.module:factory.
#   OUTBOX_HTTP_PORT        8080 (set below): /healthz (liveness), /readyz (readiness), /metrics.
#   OUTBOX_HTTP_HOST        0.0.0.0 (set below; the relay's default is 127.0.0.1): probes come
#                           from outside the container.
#   OUTBOX_DRAIN_SECONDS    45 (set below): on SIGTERM, how long sends in flight get to finish.
#                           Give the container a stop grace period longer than this.
#   OUTBOX_LOG_LEVEL        INFO (set below).
#   OUTBOX_CONCURRENCY, OUTBOX_BATCH_SIZE, OUTBOX_LEASE_SECONDS, OUTBOX_SEND_TIMEOUT,
#   OUTBOX_POLL_INTERVAL, OUTBOX_MAX_SEND_RATE (recipients/s shared by all replicas, or "auto"),
#   OUTBOX_PAUSE_SECONDS, OUTBOX_RELAY_ID, OUTBOX_SES_CONFIGURATION_SET,
#   OUTBOX_SMTP_HOST / _PORT / _SECURITY / _USERNAME / _PASSWORD: see `run --help`.
#   OUTBOX_DATABASE_URL and OUTBOX_REVISION (default heads) are the settings of `migrate`.
#
# SES is configured the boto3 way, not through OUTBOX_*: AWS_REGION or AWS_DEFAULT_REGION (the
# relay reads either; where both are set and differ, AWS_DEFAULT_REGION wins and
# `outbox-relay doctor` warns), credentials from the standard chain (an IAM role for
# the pod, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), AWS_ENDPOINT_URL_SESV2 to point it
# elsewhere. Nothing secret is baked into the image.

# Nothing floats: the base is pinned by digest (PYTHON_IMAGE, the build refuses a bare tag
# unless ALLOW_UNPINNED_BASE=1 says it is a local try) and every dependency, the build backend
# included, is the file image-requirements.txt names by version and sha256.
ARG PYTHON_IMAGE=python:3.11-slim

# -- build: the locked wheels (hash-checked) and the project's wheel -----------------------
FROM ${PYTHON_IMAGE} AS build
ARG PYTHON_IMAGE
ARG ALLOW_UNPINNED_BASE=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN case "$PYTHON_IMAGE" in \
      *@sha256:*) ;; \
      *) [ "$ALLOW_UNPINNED_BASE" = 1 ] || { \
           echo "PYTHON_IMAGE=$PYTHON_IMAGE is not pinned by digest: build with --build-arg PYTHON_IMAGE=<image>@sha256:<digest> (or ALLOW_UNPINNED_BASE=1 for a local try)" >&2; \
           exit 1; } ;; \
    esac
WORKDIR /src
COPY image-requirements.txt ./
RUN pip download --require-hashes --no-deps --only-binary=:all: --dest /wheels \
        -r image-requirements.txt \
    && pip install --no-index --find-links=/wheels --require-hashes --no-deps \
        -r image-requirements.txt
COPY pyproject.toml README.md LICENSE ./
# outbox/_migrations is a symlink to migrations/ (COPY keeps it a link): the wheel holds the files
COPY outbox ./outbox
COPY migrations ./migrations
COPY relay ./relay
RUN pip wheel --no-index --no-deps --no-build-isolation --wheel-dir /wheels .

# -- runtime: the project and the locked wheels it needs (no build backend), run as a fixed
# non-root uid ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "sqlalchemy-outbox[ses,postgres,mysql]" \
    && groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin outbox

ENV OUTBOX_SENDER=ses \
    OUTBOX_HTTP_PORT=8080 \
    OUTBOX_HTTP_HOST=0.0.0.0 \
    OUTBOX_DRAIN_SECONDS=45 \
    OUTBOX_LOG_LEVEL=INFO

# The code is compiled at install time and nothing is written at run time, so the root
# filesystem can be mounted read-only.
USER 10001:10001
EXPOSE 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('OUTBOX_HTTP_PORT', '8080'), timeout=3)"]
ENTRYPOINT ["outbox-relay"]
CMD ["run"]
