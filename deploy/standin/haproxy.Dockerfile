# Stand-in for haproxy:2.6 where no image registry is reachable: Debian 12's HAProxy package
# (2.6) run as the official image runs it (config /usr/local/etc/haproxy/haproxy.cfg, master-
# worker in the foreground, user haproxy), so that deploy/docker-compose.yml's router profile
# runs it unchanged (KVQ_HAPROXY_IMAGE). Built by scripts/docker-local-images.sh.
ARG DEBIAN_IMAGE=debian:12-slim
FROM ${DEBIAN_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /usr/local/etc/haproxy
USER haproxy
WORKDIR /var/lib/haproxy
EXPOSE 50051 8404
# SIGUSR1: soft stop (finish open connections), as the official image.
STOPSIGNAL SIGUSR1
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
