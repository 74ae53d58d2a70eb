# Redis from Debian bookworm's redis-server package (7.0), in place of redis:7.4: the same
# command line and data folder (/data, the working directory, where the AOF goes), run as
# the unprivileged user `redis` as the upstream image's entrypoint does.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
