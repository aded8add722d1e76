#!/usr/bin/env python3
"""deploy/docker-compose.yml on a real Docker engine, checked through the real network paths.

Run by scripts/test-deploy.sh, which starts the engine and makes the images first (the kvq
image from the host's build, stand-ins for Prometheus and HAProxy from Debian packages); this
file only drives docker-compose and checks what the stack answers. Phases, in order:

  up          the router profile (kvq-server = shard 0, kvq-shard-1, kvq-shard-2, kvq-router)
              and Prometheus, under its own compose project; host ports chosen by the engine
  health      gRPC health SERVING (the kvq CLI on the published port), GET /healthz 200
  router      HAProxy reports kvq-0..2 UP (its /metrics); a model registered on every shard
              directly (their container addresses); the Python client in router mode puts sequences and
              attends them (each its own data, each on exactly one shard); the C++ CLI with
              --router reads one back (seq get) and puts it under a new id (seq put), which
              the Python client then attends; a call without x-kvq-route is refused with
              INVALID_ARGUMENT naming the header (docs/ROUTER.md)
  k8s probes  every probe of deploy/k8s (the shards' StatefulSet, the router's Deployment)
              run against the same container ports of this stack (k8s_test.py probes, with
              the deploy venv's Python: --k8s-python)
  load        the load profile's kvq-load through the router (--router): exit 0, no error
  outages     while kvq-load runs through the router: shard 1 killed (SIGKILL) and started
              again, then shard 2 restarted (SIGTERM, graceful): only that shard's
              sequences fail, UNAVAILABLE for a window bounded by the router's checks, then
              NOT_FOUND (a read in flight when HAProxy resets its stream may end CANCELLED
              or UNKNOWN instead: at most CUT_PROBES_MAX per outage); no read returns another sequence's data; back UP it is empty and its
              registry (its volume) intact; kvq-load sees only UNAVAILABLE, NOT_FOUND and
              FAILED_PRECONDITION (its restarted sequences; phase_outages says why)
  dashboard   traffic for every dashboard series on kvq-server, then every Grafana panel's
              PromQL and every alert rule against the stack's Prometheus
              (deploy_test.check_dashboard_and_rules), kvq's target up, the loaded rule
              names equal to deploy/prometheus/alerts.yml's, `promtool check rules` inside
              the Prometheus container
  down        `down -v`: no container, network or volume of the project left

Usage: compose_test.py --kvq-bin BUILD/bin/kvq --k8s-python PY [--project NAME] [--keep]
Environment: KVQ_IMAGE, KVQ_PROMETHEUS_IMAGE, KVQ_HAPROXY_IMAGE (the images to run; set by
scripts/test-deploy.sh), KVQ_DOCKER (default /usr/bin/docker), KVQ_DOCKER_COMPOSE.
Needs the kvq Python package (the tests' venv). Exit 0 pass, 1 fail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, List

import grpc
import numpy as np

import kvq
from kvq._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_test as dt  # noqa: E402  (shared Prometheus checks, next to this file)

COMPOSE_FILE = os.path.join(dt.DEPLOY, "docker-compose.yml")
DOCKER = os.environ.get("KVQ_DOCKER", "/usr/bin/docker")
TENANT = "deploy-test"
D = 64  # head dim of the tiny model the router phase registers
N = 300  # sequences the Python client writes through the router
HOST = "127.0.0.1"


def log(msg: str) -> None:
    print(f"compose-test: {msg}", file=sys.stderr, flush=True)


class Stack:
    """One compose project on the router profile (plus load for `run kvq-load`)."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.base = [os.environ.get("KVQ_DOCKER_COMPOSE", "docker-compose"), "-p", project,
                     "-f", COMPOSE_FILE, "--profile", "router", "--profile", "load"]
        # Host ports chosen by the engine (0): the test never collides with a stack or a
        # server already on this machine.
        self.env = dict(os.environ)
        for var in ("KVQ_GRPC_HOST_PORT", "KVQ_METRICS_HOST_PORT", "PROMETHEUS_HOST_PORT",
                    "KVQ_ROUTER_HOST_PORT", "KVQ_ROUTER_STATS_HOST_PORT"):
            self.env[var] = "0"
        # Docker's own client first: docker-compose calls `docker` for some commands.
        self.env["PATH"] = os.path.dirname(DOCKER) + os.pathsep + self.env.get("PATH", "")

    def compose(self, *args: str, check: bool = True, timeout: float = 300,
                env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run(self.base + list(args), capture_output=True, text=True,
                           timeout=timeout, env={**self.env, **(env or {})})
        if check and r.returncode != 0:
            dt.fail(f"docker-compose {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def port(self, service: str, port: int) -> int:
        out = self.compose("port", service, str(port)).stdout.strip()
        return int(out.rsplit(":", 1)[1])

    def container_ip(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        r = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", cid)
        return r.stdout.strip()

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout

    def leftovers(self, volumes_before: List[str]) -> List[str]:
        """What the project left: containers, networks and volumes with its label, and
        volumes that did not exist before it started (anonymous ones carry no label)."""
        label = f"label=com.docker.compose.project={self.project}"
        out = []
        for kind, cmd in [("container", ["ps", "-aq"]), ("network", ["network", "ls", "-q"]),
                          ("volume", ["volume", "ls", "-q"])]:
            ids = docker(*cmd, "--filter", label).stdout.split()
            out += [f"{kind} {i}" for i in ids]
        out += [f"volume {v}" for v in volumes() if v not in volumes_before]
        return sorted(set(out))


def volumes() -> List[str]:
    return docker("volume", "ls", "-q").stdout.split()


def docker(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        dt.fail(f"docker {' '.join(args)}: {r.stderr}")
    return r


def http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=3).status
    except urllib.error.HTTPError as e:
        return e.code


def router_states(stats_port: int) -> Dict[str, str]:
    """HAProxy's state of each shard (kvq-0..2), from the router's Prometheus endpoint (the
    series whose state label holds 1)."""
    text = urllib.request.urlopen(f"http://{HOST}:{stats_port}/metrics", timeout=3).read()
    pat = r'^haproxy_server_status\{proxy="kvq_shards",server="(kvq-\d)",state="(\w+)"\} 1$'
    return dict(re.findall(pat, text.decode(), re.M))


# -- phases -------------------------------------------------------------------------------------
def phase_health(stack: Stack, kvq_bin: str) -> None:
    grpc_port, metrics_port = stack.port("kvq-server", 50051), stack.port("kvq-server", 9464)

    def serving():
        r = subprocess.run([kvq_bin, "health", "--server", f"{HOST}:{grpc_port}", "--timeout",
                            "2s", "--retries", "0"], capture_output=True, text=True, timeout=30)
        return (r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr)

    dt.wait_until("kvq-server not SERVING through its published port", serving, 60, [])
    code = http_status(f"http://{HOST}:{metrics_port}/healthz")
    if code != 200:
        dt.fail(f"GET /healthz on the published metrics port: HTTP {code}, want 200")
    log(f"health: gRPC SERVING on :{grpc_port}, /healthz 200 on :{metrics_port}")


def appends(ids: List[int], model: str) -> List[kvq.Append]:
    """Sequence i holds 1 + i % 7 tokens whose values are all i / 8 (exact in float16)."""
    return [kvq.Append(f"router-{i}", 0, 0, np.zeros((1, 1 + i % 7, D), np.float16),
                       np.full((1, 1 + i % 7, D), i / 8.0, np.float16), model=model)
            for i in ids]


def attend(client: kvq.Client, sids: List[str]) -> List[kvq.ItemResult]:
    q = np.zeros((1, 1, D), np.float32)
    return client.attend([kvq.AttendItem(s, 0, q, observe=False) for s in sids], check=False)


def check_own_data(ids: List[int], res: List[kvq.ItemResult]) -> None:
    for i, r in zip(ids, res):
        if not r.ok:
            dt.fail(f"router-{i}: attend through the router failed: {r.code} {r.message}")
        # Equal keys: attention returns the (constant) value of the sequence's own data.
        if r.tokens != 1 + i % 7 or not np.allclose(r.outputs, i / 8.0, atol=1e-2):
            dt.fail(f"router-{i}: {r.tokens} tokens, outputs {np.ravel(r.outputs)[:4]}: "
                    "not its own data")


def phase_router(stack: Stack, kvq_bin: str, tmp: str) -> List[int]:
    """Returns the shard (0..2) that holds each sequence router-i."""
    stats_port, router_port = stack.port("kvq-router", 8404), stack.port("kvq-router", 50051)
    def all_up():
        try:
            st = router_states(stats_port)
        except OSError as e:  # HAProxy not listening yet
            return (False, str(e))
        return (len(st) == 3 and set(st.values()) == {"UP"}, st)

    dt.wait_until("HAProxy does not report every shard UP", all_up, 60, [])
    router = f"{HOST}:{router_port}"
    # Models are registered on every shard directly (the router refuses RegisterBasis: it
    # would reach one shard only); the host reaches the containers on the compose network.
    shards = [f"{stack.container_ip(s)}:50051"
              for s in ("kvq-server", "kvq-shard-1", "kvq-shard-2")]
    # A random orthonormal HeadQ basis of rank 8 (one layer, one KV head).
    q = np.linalg.qr(np.random.default_rng(7).standard_normal((D, 8)))[0]
    with kvq.Client(shards, tenant=TENANT, deadline=10) as direct:
        direct.register_basis({"model": "tiny", "version": 1, "layers": 1, "kv_heads": 1,
                               "q_heads": 1, "head_dim": D, "basis_rank": 8, "kind": "random",
                               "codec": kvq.CodecSettings(rank=4)},
                              [q.astype(np.float32).reshape(1, D, 8)])
    # Refused without the routing header, by HAProxy itself.
    with grpc.insecure_channel(router) as ch:
        try:
            kvq_pb2_grpc.KvqStub(ch).Echo(kvq_pb2.EchoRequest(payload=b"x"), timeout=5)
            dt.fail("a call without x-kvq-route went through the router")
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT or "x-kvq-route" not in e.details():
                dt.fail(f"a call without x-kvq-route: {e.code()} {e.details()!r}, want "
                        "INVALID_ARGUMENT naming x-kvq-route")
    ids = list(range(N))
    with kvq.Client(router, router=True, tenant=TENANT, deadline=10) as rc:
        if rc.put_blocks(appends(ids, "tiny")).appends != N:
            dt.fail("put through the router: not every sequence appended")
        check_own_data(ids, attend(rc, [f"router-{i}" for i in ids]))
        # Each sequence on exactly one shard (asked of each shard directly).
        held = [0] * N
        owner = [-1] * N
        for n, addr in enumerate(shards):
            with kvq.Client(addr, tenant=TENANT, deadline=10) as one:
                for i, r in zip(ids, attend(one, [f"router-{i}" for i in ids])):
                    held[i] += int(r.ok)
                    owner[i] = n if r.ok else owner[i]
        if any(h != 1 for h in held):
            dt.fail(f"sequences on {sorted(set(held))} shards, want exactly 1 each")
        # The C++ client in router mode reads what Python wrote, and writes a copy.
        cli = [kvq_bin, "--server", router, "--router", "--tenant", TENANT, "--timeout", "10s"]
        f = os.path.join(tmp, "seq.safetensors")
        for args in (["seq", "get", "router-12", f], ["seq", "put", "router-cli", f,
                                                      "--model", "tiny"]):
            r = subprocess.run(cli[:1] + args + cli[1:], capture_output=True, text=True,
                               timeout=60)
            if r.returncode != 0:
                dt.fail(f"kvq {' '.join(args[:2])} --router: exit {r.returncode}: {r.stderr}")
        res = attend(rc, ["router-cli"])
        if not res[0].ok or res[0].tokens != 1 + 12 % 7 or not np.allclose(res[0].outputs,
                                                                              12 / 8.0, atol=0.05):
            dt.fail(f"router-cli (put by the CLI through the router): {res[0]}")
    log(f"router: kvq-0..2 UP; {N} sequences put and attended through :{router_port} "
        "(Python), each on one shard; CLI get/put through the router; no-header call refused")
    return owner


def phase_k8s_probes(stack: Stack, kvq_bin: str, python: str) -> None:
    ports = [f"kvq:{p}={HOST}:{stack.port('kvq-server', p)}" for p in (50051, 9464)]
    ports += [f"kvq-router:{p}={HOST}:{stack.port('kvq-router', p)}" for p in (50051, 8404)]
    r = subprocess.run([python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "k8s_test.py"), "probes", "--kvq-bin", kvq_bin,
                        *[a for p in ports for a in ("--port", p)]],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        dt.fail(f"k8s_test.py probes: exit {r.returncode}\n{r.stdout}{r.stderr}")
    log(r.stdout.strip())


def run_load(stack: Stack, name: str, env: Dict[str, str], tmp: str, *args: str,
             run_env: Dict[str, str] | None = None) -> dict:
    """The load profile's kvq-load (as compose defines it, tuned by KVQ_LOAD_* variables, or
    given args; run_env: more variables in its container); returns its JSON report. Fails on
    a non-zero exit."""
    extra = [a for k, v in (run_env or {}).items() for a in ("-e", f"{k}={v}")]
    # -T: no pseudo-terminal (CI has none; the report is read from the file).
    r = stack.compose("run", "-T", "--name", name, *extra, "kvq-load", *args, env=env, check=False,
                      timeout=600)
    report = os.path.join(tmp, f"{name}.json")
    cp = subprocess.run([DOCKER, "cp", f"{name}:/tmp/kvq-load.json", report],
                        capture_output=True, text=True)
    # -v: the image declares a VOLUME (the registry); without it each run leaves one behind.
    subprocess.run([DOCKER, "rm", "-f", "-v", name], capture_output=True)
    if r.returncode != 0 or cp.returncode != 0:
        dt.fail(f"kvq-load ({name}): exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    with open(report) as f:
        return json.load(f)


# The load profile through the router: kvq-load's synthetic model, registered on every shard
# by phase_load's setup run, named with --model (KVQ_MODEL).
ROUTER_LOAD_RUN_ENV = {"KVQ_MODEL": "kvq-load-l2-q32-kv8-d128-r16"}


LOAD_STREAMS = 4  # kvq-load's concurrency through the router
# Calls of kvq-load cut (UNKNOWN, CANCELLED) by the two outages, at most: each of its streams
# may lose the call in flight and the ones sent to the dead shard before the router marks it
# down (phase_outages).
CUT_CALLS_MAX = 4 * LOAD_STREAMS
# Reads of the probe (one batch of attends every 50 ms) cut the same way while its shard goes
# away, at most: the batch in flight when HAProxy resets the stream (seen once in a CI run
# with a graceful restart), counted per outage.
CUT_PROBES_MAX = 2
CUT = {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


def router_load_env(duration: str) -> Dict[str, str]:
    return {"KVQ_LOAD_SERVER": "kvq-router:50051", "KVQ_LOAD_ROUTER": "1",
            "KVQ_LOAD_DURATION": duration, "KVQ_LOAD_CONCURRENCY": str(LOAD_STREAMS),
            "KVQ_LOAD_CONTEXT": "512"}


def phase_load(stack: Stack, tmp: str) -> None:
    # kvq-load's synthetic model, registered on every shard directly by a one-request run
    # (in router mode kvq-load refuses to register: the router would reach one shard only),
    # then named with --model (KVQ_MODEL) in the run through the router.
    compose_shards = "kvq-server:50051,kvq-shard-1:50051,kvq-shard-2:50051"
    run_load(stack, f"{stack.project}-load-setup", {}, tmp, f"--server={compose_shards}",
             "--requests=1", "--progress=0", "--json=/tmp/kvq-load.json")
    rep = run_load(stack, f"{stack.project}-load", router_load_env("15s"), tmp,
                   run_env=ROUTER_LOAD_RUN_ENV)
    total = sum(m.get("requests", 0) for m in rep["methods"].values())
    if rep.get("errors_by_code") or total == 0:
        dt.fail(f"load through the router: {total} requests, errors {rep.get('errors_by_code')}")
    per_method = ", ".join(f"{k} {v.get('requests', 0)}" for k, v in rep["methods"].items())
    log(f"load: {total} requests through the router, 0 errors ({per_method})")


# The router's shipped checks (deploy/haproxy/haproxy.cfg): a shard whose port refuses
# connections is marked down at most inter + (fall-1) x fastinter = 2.5 s after it died, a
# silent one 4.5 s; until then its sequences fail with UNAVAILABLE, after it NOT_FOUND (their
# keys moved). SLACK covers a loaded 2-core machine.
DOWN_BOUND, SLACK = 4.5, 3.0


def shard_outage(stack: Stack, kvq_bin: str, owner: List[int], n: int, how: str) -> str:
    """Takes shard n (compose service) out by `how` ("kill": SIGKILL, then `start`;
    "restart": `docker-compose restart`, SIGTERM and a graceful drain) while reading its
    sequences and others' through the router every 50 ms. Checks: the others never fail;
    its own fail only with UNAVAILABLE or NOT_FOUND; every OK read is the sequence's own
    data; UNAVAILABLE ends within DOWN_BOUND (+ SLACK) of the first failure; once back UP it
    is empty (NOT_FOUND: kvq keeps sequences in memory) and its registry was reloaded from
    its volume (the tiny model listed on it directly); its sequences put again through the
    router read back. Returns the timings."""
    service = ["kvq-server", "kvq-shard-1", "kvq-shard-2"][n]
    stats_port = stack.port("kvq-router", 8404)
    router = f"{HOST}:{stack.port('kvq-router', 50051)}"
    lost = [i for i in range(N) if owner[i] == n][:40]
    kept = [i for i in range(N) if owner[i] != n][:40]
    sids = [f"router-{i}" for i in lost + kept]
    cid = stack.compose("ps", "-q", service).stdout.strip()
    t0 = time.monotonic()
    if how == "kill":
        docker("kill", cid)
        t0 = time.monotonic()  # from the moment the process is dead
        action = None
    else:
        action = subprocess.Popen(stack.base + ["restart", "-t", "15", service], env=stack.env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_fail = unavailable_end = None
    cut_probes = 0
    with kvq.Client(router, router=True, tenant=TENANT, deadline=2, max_attempts=1) as probe:
        while time.monotonic() - t0 < 40:
            res = attend(probe, sids)
            now = time.monotonic() - t0
            bad = [(i, r.code) for i, r in zip(kept, res[len(lost):]) if not r.ok]
            if bad:
                dt.fail(f"{how} of {service}: another shard's sequences failed: {bad[:3]}")
            check_own_data_ok(lost + kept, res)
            codes = {r.code for r in res[:len(lost)]}
            if codes & CUT:
                cut_probes += 1
                codes -= CUT
            if cut_probes > CUT_PROBES_MAX:
                dt.fail(f"{how} of {service}: {cut_probes} probe reads cut (CANCELLED or UNKNOWN), "
                        f"at most {CUT_PROBES_MAX}")
            if not codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE,
                             grpc.StatusCode.NOT_FOUND}:
                dt.fail(f"{how} of {service}: its sequences failed with {codes}")
            if codes != {grpc.StatusCode.OK} and first_fail is None:
                first_fail = now
            if codes == {grpc.StatusCode.NOT_FOUND}:
                unavailable_end = now
                break
            time.sleep(0.05)
    if first_fail is None or unavailable_end is None:
        dt.fail(f"{how} of {service}: its sequences never became NOT_FOUND "
                f"(first failure at {first_fail})")
    # The window: from the kill (or the restart's SIGTERM) until its sequences answer
    # NOT_FOUND (the router marked it down, or it came back empty). Times are taken when a
    # read returns, so a read that hung on the dead shard counts in full.
    window = unavailable_end
    if window > DOWN_BOUND + SLACK:
        dt.fail(f"{how} of {service}: its sequences failed otherwise than NOT_FOUND for "
                f"{window:.2f}s, bound {DOWN_BOUND}s + {SLACK}s")
    if action is None:
        stack.compose("start", service)
    elif action.wait(timeout=120) != 0:
        dt.fail(f"docker-compose restart {service}: exit {action.returncode}")

    def back_up():
        try:
            st = router_states(stats_port)
        except OSError as e:
            return (False, str(e))
        return (st.get(f"kvq-{n}") == "UP", st)

    dt.wait_until(f"{service} not UP again after the {how}", back_up, 60, [])
    t_up = time.monotonic() - t0
    with kvq.Client(router, router=True, tenant=TENANT, deadline=5) as rc:
        res = attend(rc, sids)
    if {r.code for r in res[:len(lost)]} != {grpc.StatusCode.NOT_FOUND}:
        dt.fail(f"{service} back: its sequences read {[r.code for r in res[:len(lost)]][:5]}, "
                "want NOT_FOUND (an empty store; never another copy)")
    check_own_data_ok(lost + kept, res)
    if not all(r.ok for r in res[len(lost):]):
        dt.fail(f"{service} back: another shard's sequences failed")
    # The frontend's answer to NOT_FOUND: put them again; they land on the returned shard.
    with kvq.Client(router, router=True, tenant=TENANT, deadline=10) as rc:
        rc.put_blocks(appends(lost, "tiny"))
        check_own_data(lost, attend(rc, [f"router-{i}" for i in lost]))
    r = subprocess.run([kvq_bin, "models", "list", "--server",
                        f"{stack.container_ip(service)}:50051", "--tenant", TENANT],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0 or "tiny" not in r.stdout:
        dt.fail(f"{service} back: its registry lost the model: {r.stdout}{r.stderr}")
    return (f"{how} {service}: its {len(lost)} probed sequences failed from the read "
            f"returning at {first_fail:.2f}s, NOT_FOUND from {window:.2f}s (bound "
            f"{DOWN_BOUND}s); UP again at {t_up:.1f}s, empty, registry intact, re-put")


def check_own_data_ok(ids: List[int], res: List[kvq.ItemResult]) -> None:
    """Every OK read is sequence i's own data (a failed one is judged by the caller)."""
    for i, r in zip(ids, res):
        if r.ok and (r.tokens != 1 + i % 7 or not np.allclose(r.outputs, i / 8.0, atol=1e-2)):
            dt.fail(f"router-{i}: read another sequence's data ({r.tokens} tokens)")


def phase_outages(stack: Stack, kvq_bin: str, owner: List[int], tmp: str) -> None:
    """One shard killed and restarted, another restarted gracefully (a rolling restart's
    step), while kvq-load runs through the router: kvq-load sees only UNAVAILABLE, NOT_FOUND
    and FAILED_PRECONDITION (its sequences on those shards; see below), the probes above
    hold."""
    name = f"{stack.project}-load-outage"
    load = subprocess.Popen(
        stack.base + ["run", "-T", "--name", name]
        + [a for k, v in ROUTER_LOAD_RUN_ENV.items() for a in ("-e", f"{k}={v}")]
        + ["kvq-load", "--server=kvq-router:50051", "--duration=600s",
           f"--concurrency={LOAD_STREAMS}",
           "--context=512", "--mix=attend:8,put:1,score:1", "--progress=0",
           "--json=/tmp/kvq-load.json"],
        env={**stack.env, **router_load_env("600s")}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
        if load.poll() is not None:
            dt.fail(f"kvq-load under the outages exited early: {load.stdout.read()}")
        for n, how in [(1, "kill"), (2, "restart")]:
            log(f"outage: {shard_outage(stack, kvq_bin, owner, n, how)}")
    finally:
        # SIGINT: kvq-load prints and writes its report of what ran, exit 130.
        subprocess.run([DOCKER, "kill", "-s", "INT", name], capture_output=True)
        out, _ = load.communicate(timeout=60)
    report = os.path.join(tmp, "outage.json")
    subprocess.run([DOCKER, "cp", f"{name}:/tmp/kvq-load.json", report], capture_output=True)
    subprocess.run([DOCKER, "rm", "-f", "-v", name], capture_output=True)
    if not os.path.exists(report):
        dt.fail(f"kvq-load under the outages wrote no report: {out[-2000:]}")
    with open(report) as f:
        rep = json.load(f)
    errors = rep.get("errors_by_code") or {}
    total = sum(m.get("requests", 0) for m in rep["methods"].values())
    # A call cut while its shard goes away ends UNKNOWN (no gRPC trailers) or CANCELLED
    # (HAProxy resets the stream), not the documented UNAVAILABLE: 1 to 5 per run here
    # (README, deployment test). Allowed up to CUT_CALLS_MAX, a weakness to fix in the router
    # or the clients, not hidden: anything else fails the test.
    cut = errors.get("UNKNOWN", 0) + errors.get("CANCELLED", 0)
    # FAILED_PRECONDITION: kvq-load answers a NOT_FOUND put by starting every sequence of its
    # session again from token 0 (client/load/main.cc), so its next calls on a sequence that
    # came back shorter on the emptied shard can refuse a position or an empty layer (53 of
    # 41,275 in one CI run). kvq-load's report does not say which shard a failed call went to;
    # the probes above check, sequence by sequence, that only the lost shard's fail.
    allowed = {"UNAVAILABLE", "NOT_FOUND", "FAILED_PRECONDITION", "UNKNOWN", "CANCELLED"}
    if not set(errors) <= allowed or cut > CUT_CALLS_MAX or total == 0:
        per_method = {m: v.get("errors") for m, v in rep["methods"].items()}
        dt.fail(f"kvq-load under the outages: {total} requests, errors {errors}; by method "
                f"{per_method}")
    log(f"outage: kvq-load through the router meanwhile: {total} requests, errors {errors}")


def phase_dashboard(stack: Stack, kvq_bin: str, tmp: str) -> None:
    # Traffic for every series the dashboard shows, on kvq-server (Prometheus scrapes it):
    # every method, a tenant of its own, and an error (NOT_FOUND).
    run_load(stack, f"{stack.project}-load-dash", {}, tmp,
             "--server=kvq-server:50051", "--tenant=dash-tenant", "--requests=120",
             "--concurrency=2", "--context=96", "--layers=2", "--q-heads=4", "--kv-heads=2",
             "--head-dim=64", "--basis-rank=8", "--keep", "--progress=0",
             "--mix=attend:2,put:1,score:1,readout:1", "--baseline=noop",
             "--json=/tmp/kvq-load.json")
    r = subprocess.run([kvq_bin, "seq", "delete", "no-such-sequence", "--server",
                        f"{HOST}:{stack.port('kvq-server', 50051)}"], capture_output=True,
                       timeout=60)
    if r.returncode != 15:
        dt.fail(f"kvq seq delete of a missing sequence: exit {r.returncode}, want 15")
    base = f"http://{HOST}:{stack.port('prometheus', 9090)}"

    def target_up():
        targets = dt.http_json(f"{base}/api/v1/targets")["data"]["activeTargets"]
        kvq_t = [t for t in targets if t["labels"].get("job") == "kvq"]
        return (len(kvq_t) == 1 and kvq_t[0]["health"] == "up", kvq_t)

    dt.wait_until("Prometheus does not scrape kvq-server (target not up)", target_up, 60, [])
    names = dt.check_dashboard_and_rules(base, "dash-tenant", [])
    groups = dt.http_json(f"{base}/api/v1/rules")["data"]["groups"]
    loaded = sorted(r["name"] for g in groups for r in g["rules"])
    with open(os.path.join(dt.DEPLOY, "prometheus", "alerts.yml")) as f:
        wanted = sorted(re.findall(r"^\s*- (?:alert|record):\s*(\S+)", f.read(), re.M))
    if loaded != wanted:
        dt.fail(f"Prometheus loaded rules {loaded}, alerts.yml has {wanted}")
    r = stack.compose("exec", "-T", "prometheus", "promtool", "check", "rules",
                      "/etc/prometheus/alerts.yml", check=False)
    if r.returncode != 0:
        dt.fail(f"promtool check rules in the Prometheus container: {r.stdout}{r.stderr}")
    log(f"dashboard: kvq target up; {len(dt.dashboard_queries())} panel queries and "
        f"{len(names)} metrics answered; {len(loaded)} rules loaded and healthy; promtool OK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq-bin", required=True, help="the kvq CLI of the host build")
    ap.add_argument("--k8s-python", required=True,
                    help="a Python with tests/deploy/requirements.txt (k8s_test.py probes)")
    ap.add_argument("--project", default="kvqdeploytest", help="compose project name")
    ap.add_argument("--keep", action="store_true", help="leave the stack up (no down -v)")
    args = ap.parse_args()
    stack = Stack(args.project)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvq-compose-") as tmp:
        stack.compose("down", "-v", "--remove-orphans", check=False)
        volumes_before = volumes()
        try:
            stack.compose("up", "-d", "--no-build", "kvq-server", "prometheus", "kvq-shard-1",
                          "kvq-shard-2", "kvq-router")
            log(f"up in {time.monotonic() - t0:.1f}s")
            phase_health(stack, args.kvq_bin)
            owner = phase_router(stack, args.kvq_bin, tmp)
            phase_k8s_probes(stack, args.kvq_bin, args.k8s_python)
            phase_load(stack, tmp)
            phase_outages(stack, args.kvq_bin, owner, tmp)
            phase_dashboard(stack, args.kvq_bin, tmp)
        except BaseException:
            print(stack.logs(), file=sys.stderr)
            raise
        finally:
            if not args.keep:
                stack.compose("down", "-v", "--remove-orphans", "-t", "20", check=False)
    if not args.keep:
        left = stack.leftovers(volumes_before)
        if left:
            dt.fail(f"down -v left {left}")
        log("down -v: no container, network or volume left")
    log(f"OK in {time.monotonic() - t0:.1f}s")


if __name__ == "__main__":
    main()
