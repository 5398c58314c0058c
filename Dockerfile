# tokenq's worker and gateway (CPU torch; for GPUs start from an image with CUDA torch
# instead).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENQ_CACHE_DIR=/models

WORKDIR /app
# A C compiler for kernels/cpu_ops.c, built for the host CPU on first use (without one the
# engine runs its slower plain-torch path).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY producer producer
COPY worker worker
COPY tokenq tokenq
RUN pip install '.[worker,serve]'
# The default model is baked into the image: workers never download at run time.
RUN python -m tokenq.engine.downloads fetch

ENTRYPOINT ["tokenq"]
CMD ["worker"]
