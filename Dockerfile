# One image for every timeslice service: orchestrator, agent, CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
# cuda-bindings for the agent's cuda backend (it imports without a GPU; calls need the driver
# the NVIDIA container toolkit injects). The orchestrator and CLI run as an unprivileged user;
# the agent's manifests run it as root, which checkpointing and signalling other processes need.
RUN pip install --no-cache-dir '.[cuda]' && useradd --system --uid 10001 timeslice
USER 10001
ENTRYPOINT ["timeslice"]
