# Python 3.11 from Debian bookworm's packages, in place of python:3.11-slim: the base
# deploy/Dockerfile.cpu builds on when no registry is reachable (scripts/offline_images.sh).
# With the headers, as python:3.11-slim has them: vLLM compiles its CPU sampler at run time.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s python3 /usr/bin/python
CMD ["python3"]
