#!/usr/bin/env python3
"""The Kubernetes manifests of deploy/k8s against the Kubernetes schemas, and their probes
against a real kvq-server and router.

  k8s_test.py validate
      every resource of deploy/k8s/*.yaml (kustomization.yaml aside: not a cluster resource)
      validated, strict (unknown fields rejected), against the schemas of Kubernetes
      VERSIONS below, by kubernetes-validate (pinned in tests/deploy/requirements.txt)
  k8s_test.py probes --kvq-bin K --port WORKLOAD:CONTAINER_PORT=HOST:PORT ...
      every readiness/liveness/startup probe of the StatefulSet and the Deployments, run the
      way the kubelet runs it against the address its container port is published on
      (compose_test.py passes the compose stack's ports: the kvq StatefulSet's on kvq-server,
      the kvq-router Deployment's on kvq-router): grpc -> grpc.health.v1 SERVING (the kvq
      CLI's health check), httpGet -> HTTP 2xx/3xx, tcpSocket -> a connection accepted

Run by scripts/test-deploy.sh with the deploy venv's Python. Exit 0 pass, 1 fail.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any, Dict, Iterator, List, Tuple

import kubernetes_validate
import yaml

K8S = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "deploy", "k8s")
# 1.27: the first release with gRPC probes GA (the shards use them); 1.37: the newest the
# pinned kubernetes-validate knows.
VERSIONS = ("1.27.0", "1.37.0")


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def resources() -> Iterator[Tuple[str, Dict[str, Any]]]:
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    yield os.path.basename(path), doc


def validate() -> None:
    n = 0
    for name, doc in resources():
        what = f"{name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                fail(f"{what} is not valid Kubernetes {version} at {path or '(top)'}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                fail(f"{what}: no Kubernetes {version} schema: {e}")
        n += 1
    if n < 8:
        fail(f"only {n} resources in deploy/k8s")
    print(f"k8s validate: {n} resources valid (strict) against Kubernetes {', '.join(VERSIONS)}")


def probes() -> Iterator[Tuple[str, str, Dict[str, Any], Dict[str, int]]]:
    """(workload, probe kind, probe, container port by name) of every container."""
    for _, doc in resources():
        if doc.get("kind") not in ("StatefulSet", "Deployment", "DaemonSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                if kind in c:
                    yield doc["metadata"]["name"], kind, c[kind], ports


def run_probe(workload: str, kind: str, probe: Dict[str, Any], ports: Dict[str, int],
              published: Dict[Tuple[str, int], str], kvq_bin: str) -> str:
    (handler, spec), = [(k, v) for k, v in probe.items() if k in ("grpc", "httpGet",
                                                                 "tcpSocket", "exec")]
    if handler == "exec":
        fail(f"{workload} {kind}: exec probes are not checked here; use grpc/httpGet/tcpSocket")
    port = spec["port"]
    port = ports.get(port, port) if isinstance(port, str) else port
    addr = published.get((workload, port))
    if addr is None:
        fail(f"{workload} {kind}: container port {port} has no published address to test "
             f"(have {sorted(published)})")
    if handler == "grpc":
        if spec.get("service"):
            fail(f"{workload} {kind}: grpc probe of service {spec['service']!r}; kvq-server "
                 "answers the overall health (service \"\")")
        r = subprocess.run([kvq_bin, "health", "--server", addr, "--timeout", "3s",
                            "--retries", "0"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            fail(f"{workload} {kind}: grpc probe on {addr}: exit {r.returncode} {r.stderr}")
        return f"grpc {addr} SERVING"
    if handler == "httpGet":
        url = f"http://{addr}{spec.get('path', '/')}"
        try:
            code = urllib.request.urlopen(url, timeout=3).status
        except urllib.error.HTTPError as e:
            code = e.code
        except OSError as e:
            fail(f"{workload} {kind}: GET {url}: {e}")
        if not 200 <= code < 400:
            fail(f"{workload} {kind}: GET {url}: HTTP {code} (the kubelet wants 2xx/3xx)")
        return f"GET {spec.get('path', '/')} {code}"
    host, p = addr.rsplit(":", 1)
    try:
        socket.create_connection((host, int(p)), timeout=3).close()
    except OSError as e:
        fail(f"{workload} {kind}: tcpSocket {addr}: {e}")
    return f"tcp {addr} open"


def check_probes(args: argparse.Namespace) -> None:
    published: Dict[Tuple[str, int], str] = {}
    for spec in args.port:
        left, addr = spec.split("=", 1)
        workload, port = left.rsplit(":", 1)
        published[(workload, int(port))] = addr
    done: List[str] = []
    for workload, kind, probe, ports in probes():
        done.append(f"{workload} {kind}: {run_probe(workload, kind, probe, ports, published, args.kvq_bin)}")
    workloads = {d.split()[0] for d in done}
    if not {"kvq", "kvq-router"} <= workloads:
        fail(f"probes found only for {sorted(workloads)}")
    print("k8s probes: " + "; ".join(done))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=["validate", "probes"])
    ap.add_argument("--kvq-bin", help="the kvq CLI (probes)")
    ap.add_argument("--port", action="append", default=[],
                    help="WORKLOAD:CONTAINER_PORT=HOST:PORT (probes; repeat)")
    args = ap.parse_args()
    if args.check == "validate":
        validate()
    else:
        if not args.kvq_bin or not args.port:
            ap.error("probes needs --kvq-bin and --port")
        check_probes(args)


if __name__ == "__main__":
    main()
