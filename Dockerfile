FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    RESIPLAN_DATABASE_URL=sqlite:////data/resiplan.db

WORKDIR /app
COPY pyproject.toml README.md cli.py ./
COPY wire ./wire
COPY api ./api
COPY planner ./planner
COPY detector ./detector
COPY cost_models ./cost_models
COPY adapters ./adapters
COPY render ./render
COPY executor ./executor
COPY benchmarks ./benchmarks
RUN pip install --no-cache-dir ".[postgres]" \
    && useradd --create-home --uid 10001 resiplan \
    && mkdir -p /data && chown resiplan /data

USER resiplan
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"
CMD ["resiplan", "serve", "--host", "0.0.0.0", "--port", "8000"]
