# Stand-in for prom/prometheus where no image registry is reachable: Debian 12's Prometheus
# package (2.42) laid out as the official image is (entrypoint /bin/prometheus, which Debian's
# merged /usr provides; /prometheus owned by nobody; config at /etc/prometheus/prometheus.yml),
# so that deploy/docker-compose.yml runs it unchanged (KVQ_PROMETHEUS_IMAGE). promtool comes
# with it. Built by scripts/docker-local-images.sh.
ARG DEBIAN_IMAGE=debian:12-slim
FROM ${DEBIAN_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
VOLUME ["/prometheus"]
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
