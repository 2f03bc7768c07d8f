# One image for every timeslice service: orchestrator, agent, CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install --no-cache-dir . && useradd --system --uid 10001 timeslice
USER 10001
ENTRYPOINT ["timeslice"]
