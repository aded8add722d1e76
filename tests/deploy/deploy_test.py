#!/usr/bin/env python3
"""Checks of deploy/ that need no Docker engine.

  deploy_test.py compose     docker-compose config (with and without the load profile)
  deploy_test.py promtool    promtool check config / check rules on deploy/prometheus/
  deploy_test.py manifests   Dockerfiles, Kubernetes manifests and the dashboard agree
  deploy_test.py haproxy     haproxy -c on deploy/haproxy/haproxy.cfg (the router; its loopback
                             test is client/python/tests/test_router.py)
  deploy_test.py scrape --server-bin B --load-bin L --kvq-bin K
                             a real kvq-server and Debian's real Prometheus on loopback:
                             Prometheus scrapes kvq, and every metric (and every query) of the
                             Grafana dashboard exists in that scrape

Exit 0 pass, 1 fail, 77 skipped (a tool is missing), as ctest's SKIP_RETURN_CODE.
Only the standard library is needed (PyYAML is used when present).
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
DASHBOARD = os.path.join(DEPLOY, "grafana", "dashboards", "kvq.json")
SKIP = 77


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def need(tool):
    path = shutil.which(tool)
    if path is None:
        print(f"SKIP: {tool} is not installed (scripts/install-deps.sh installs it)")
        sys.exit(SKIP)
    return path


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# ---------------------------------------------------------------------------------------------
def check_compose():
    dc = need("docker-compose")
    f = os.path.join(DEPLOY, "docker-compose.yml")
    r = run([dc, "-f", f, "config", "-q"])
    if r.returncode != 0:
        fail(f"docker-compose config: {r.stderr}")
    r = run([dc, "-f", f, "--profile", "load", "config", "--services"])
    services = set(r.stdout.split())
    if services != {"kvq-server", "prometheus", "grafana", "kvq-load", "kvq-shard-1",
                    "kvq-shard-2", "kvq-router"}:
        fail(f"services are {sorted(services)}")
    # kvq-load only under the "load" profile, the router and its extra shards under "router"
    # (docker-compose 1.29 lists them either way).
    text = open(f).read()
    for name, profile in [("kvq-load", "load"), ("kvq-shard-1", "router"),
                          ("kvq-router", "router")]:
        block = text[text.index(f"\n  {name}:"):]
        block = block[:block.find("\n\n") if "\n\n" in block else None]
        if not re.search(rf'^    profiles: \["{profile}"\]', block, re.M):
            fail(f"{name} must be under the '{profile}' profile")
    r = run([dc, "-f", f, "--profile", "load", "config"])
    cfg = r.stdout
    for want in ["--server=kvq-server:50051", "--baseline=noop", "service_healthy",
                 "/etc/grafana/provisioning", "/var/lib/grafana/dashboards"]:
        if want not in cfg:
            fail(f"compose config lacks {want!r}")
    r = run([dc, "-f", f, "--profile", "router", "config"])
    cfg = r.stdout
    for want in ["KVQ_SHARD_0: kvq-server:50051", "KVQ_SHARD_1: kvq-shard-1:50051",
                 "KVQ_SHARD_2: kvq-shard-2:50051", "/usr/local/etc/haproxy", "haproxy:2.6"]:
        if want not in cfg:
            fail(f"compose config (router profile) lacks {want!r}")
    prom = open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")).read()
    if "kvq-server:9464" not in prom:
        fail("prometheus.yml does not scrape kvq-server:9464")
    print("compose: OK")


def check_promtool():
    pt = need("promtool")
    r = run([pt, "check", "config", os.path.join(DEPLOY, "prometheus", "prometheus.yml")])
    if r.returncode != 0:
        fail(f"promtool: {r.stdout}{r.stderr}")
    r = run([pt, "check", "rules", os.path.join(DEPLOY, "prometheus", "alerts.yml")])
    if r.returncode != 0:
        fail(f"promtool check rules: {r.stdout}{r.stderr}")
    print("promtool: OK")


# ---------------------------------------------------------------------------------------------
def load_yaml_docs(path):
    try:
        import yaml  # noqa: PLC0415
    except ImportError:
        print("SKIP: PyYAML missing (python3-yaml)")
        sys.exit(SKIP)
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def check_manifests():
    # Dockerfiles: multi-stage, Debian 12 (CPU), non-root final stage.
    for name, base in [("Dockerfile", "debian:12"), ("Dockerfile.cuda", "nvidia/cuda:")]:
        text = open(os.path.join(DEPLOY, name)).read()
        froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
        if len(froms) < 2:
            fail(f"{name}: not multi-stage")
        if base not in text:
            fail(f"{name}: base image {base} missing")
        final = text[text.rfind("\nFROM "):]
        user = re.findall(r"^USER\s+(\S+)", final, re.M)
        if not user or user[-1].split(":")[0] in ("0", "root"):
            fail(f"{name}: the final stage must run as a non-root USER")
        code = "\n".join(l for l in final.splitlines() if not l.lstrip().startswith("#"))
        if re.search(r"-dev\b", code):
            fail(f"{name}: the final stage installs -dev packages")
        if "runtime-packages.txt" not in code:
            fail(f"{name}: the final stage must install the packages listed by the build stage")
        for port in ("50051", "9464"):
            if port not in final:
                fail(f"{name}: port {port} not set in the final stage")

    docs = []
    for f in ("configmap.yaml", "service.yaml", "statefulset.yaml", "kvq-load-job.yaml",
              "router.yaml"):
        docs += load_yaml_docs(os.path.join(DEPLOY, "k8s", f))
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    sts = by_kind["StatefulSet"][0]
    svc = [s for s in by_kind["Service"] if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    if not svc or svc[0]["spec"].get("clusterIP") != "None":
        fail("the StatefulSet's serviceName must be a headless Service (clusterIP: None)")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for sel in (sts["spec"]["selector"]["matchLabels"], svc[0]["spec"]["selector"]):
        if any(labels.get(k) != v for k, v in sel.items()):
            fail(f"selector {sel} does not match the pod labels {labels}")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc[0]["spec"]["ports"]:
        if p["targetPort"] not in ports:
            fail(f"service targetPort {p['targetPort']} is not a container port")
    if not sts["spec"]["template"]["spec"]["securityContext"].get("runAsNonRoot"):
        fail("pods must run as non-root")
    maps = {m["metadata"]["name"]: m["data"] for m in by_kind["ConfigMap"]}
    servers = maps["kvq-client"]["KVQ_SERVER"].split(",")
    want = [f"{sts['metadata']['name']}-{i}.{svc[0]['metadata']['name']}:{ports['grpc']}"
            for i in range(sts["spec"]["replicas"])]
    if servers != want:
        fail(f"kvq-client KVQ_SERVER {servers} must list every shard: {want}")
    if maps["kvq-server"]["KVQ_GRPC_PORT"] != str(ports["grpc"]) or \
            maps["kvq-server"]["KVQ_METRICS_PORT"] != str(ports["metrics"]):
        fail("kvq-server ConfigMap ports differ from the container ports")
    # The router: its ConfigMap holds deploy/haproxy's files verbatim, its shards are the
    # StatefulSet's pods by their stable (fully qualified) names, and kustomize applies it.
    router_cfg = maps["kvq-router"]
    for name in ("haproxy.cfg", "missing-route.grpc.http"):
        with open(os.path.join(DEPLOY, "haproxy", name), newline="") as fh:
            if router_cfg.get(name) != fh.read():
                fail(f"deploy/k8s/router.yaml: ConfigMap kvq-router's {name} differs from "
                     f"deploy/haproxy/{name} (copy the file into it)")
    dep = [d for d in by_kind["Deployment"] if d["metadata"]["name"] == "kvq-router"][0]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    for i in range(sts["spec"]["replicas"]):
        want = (f"{sts['metadata']['name']}-{i}.{svc[0]['metadata']['name']}.$(POD_NAMESPACE)"
                f".svc.$(KVQ_CLUSTER_DOMAIN):{ports['grpc']}")
        if env.get(f"KVQ_SHARD_{i}") != want:
            fail(f"kvq-router KVQ_SHARD_{i} is {env.get(f'KVQ_SHARD_{i}')}, expected {want}")
    names = [e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
             if e["name"] == "KVQ_ROUTER_NAME"]
    if not names or names[0].get("valueFrom") != {"fieldRef": {"fieldPath": "metadata.name"}}:
        fail("kvq-router must set KVQ_ROUTER_NAME to the pod's name (each replica's probes "
             "are watched apart)")
    check_probe_gap(maps["kvq-server"].get("KVQ_DROP_AFTER_PROBE_GAP"),
                    "deploy/k8s/configmap.yaml KVQ_DROP_AFTER_PROBE_GAP")
    compose = open(os.path.join(DEPLOY, "docker-compose.yml")).read()
    gaps = re.findall(r"KVQ_DROP_AFTER_PROBE_GAP: \$\{KVQ_DROP_AFTER_PROBE_GAP:-(\S+)\}", compose)
    if len(gaps) != 2:  # kvq-server and the shards' anchor
        fail(f"docker-compose.yml sets KVQ_DROP_AFTER_PROBE_GAP {len(gaps)} times, expected 2")
    for g in gaps:
        check_probe_gap(g, "docker-compose.yml KVQ_DROP_AFTER_PROBE_GAP")
    kust = open(os.path.join(DEPLOY, "k8s", "kustomization.yaml")).read()
    if "router.yaml" not in kust:
        fail("kustomization.yaml does not apply router.yaml")
    job = by_kind["Job"][0]["spec"]["template"]["spec"]["containers"][0]
    if {"configMapRef": {"name": "kvq-client"}} not in job.get("envFrom", []):
        fail("the kvq-load Job must take KVQ_SERVER from the kvq-client ConfigMap")
    kubectl = shutil.which("kubectl")
    if kubectl:
        r = run([kubectl, "kustomize", os.path.join(DEPLOY, "k8s")])
        if r.returncode != 0:
            fail(f"kubectl kustomize: {r.stderr}")

    # The dashboard: valid JSON, every panel queries Prometheus through the datasource variable.
    dash = json.load(open(DASHBOARD))
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    if len(panels) < 10:
        fail("the dashboard has fewer than 10 panels")
    for p in panels:
        if not p.get("targets") or any(not t.get("expr") for t in p["targets"]):
            fail(f"panel {p['title']!r} has no query")
    prov = open(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards", "kvq.yml")).read()
    if "/var/lib/grafana/dashboards" not in prov:
        fail("the dashboard provider does not point at the mounted folder")
    print("manifests: OK")


def seconds(duration):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s)", duration or "")
    if not m:
        fail(f"cannot read the duration {duration!r}")
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def check_probe_gap(value, where):
    """The shards' --drop-after-probe-gap must lie between the router's check interval and
    the shortest time in which it can mark a running shard down (docs/ROUTER.md), with the
    defaults of haproxy.cfg, and the router's checks must say who sends them."""
    cfg = open(os.path.join(DEPLOY, "haproxy", "haproxy.cfg")).read()
    if not re.search(r"^\s*http-check send .*hdr x-kvq-probe ", cfg, re.M):
        fail("haproxy.cfg: the checks must carry x-kvq-probe (http-check send ... hdr)")

    def default(name):
        m = re.search(r'"\$\{KVQ_ROUTER_CHECK_' + name + r'-([^}]+)\}"', cfg)
        if not m:
            fail(f"haproxy.cfg: no default for KVQ_ROUTER_CHECK_{name}")
        return m.group(1)
    inter, fastinter = seconds(default("INTER")), seconds(default("FASTINTER"))
    fall = int(default("FALL"))
    gap = seconds(value)
    if not inter < gap < inter + (fall - 1) * fastinter:
        fail(f"{where} {value} must lie between haproxy.cfg's inter ({inter}s) and inter + "
             f"(fall - 1) x fastinter ({inter + (fall - 1) * fastinter}s)")


# ---------------------------------------------------------------------------------------------
def check_haproxy():
    hap = need("haproxy")
    env = dict(os.environ)
    for i in range(3):  # addresses that need no DNS
        env[f"KVQ_SHARD_{i}"] = f"127.0.0.1:{50061 + i}"
    r = run([hap, "-c", "-f", os.path.join(DEPLOY, "haproxy", "haproxy.cfg")], env=env)
    out = r.stdout + r.stderr
    if r.returncode != 0 or "[WARNING]" in out or "[ALERT]" in out:
        fail(f"haproxy -c: {out}")
    print("haproxy: OK")


# ---------------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def prom_query(base, expr):
    q = urllib.parse.urlencode({"query": expr})
    try:
        return http_json(f"{base}/api/v1/query?{q}")
    except urllib.error.HTTPError as e:  # 400: a bad query; the body says why
        return json.loads(e.read().decode())


def dashboard_queries():
    dash = json.load(open(DASHBOARD))
    exprs = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            exprs.append((f"variable {v['name']}", v["definition"]))
    return exprs


def substitute(expr):
    # Grafana's variables as "All" and a rate window a 1 s scrape fills.
    return (expr.replace("$__rate_interval", "30s").replace("$instance", ".*")
            .replace("$tenant", ".*"))


def wait_until(what, fn, timeout, proc_logs):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(0.5)
    for name, path in proc_logs:
        try:
            print(f"--- {name} log (tail) ---\n" + open(path).read()[-3000:], file=sys.stderr)
        except OSError:
            pass
    fail(f"{what} (gave up after {timeout} s): {last}")


def check_dashboard_and_rules(base, tenant, logs):
    """Against the Prometheus at base (which scrapes a kvq-server that has served every method,
    an error and the given tenant): every metric the Grafana dashboard names exists, every
    panel's query is valid PromQL with data, every alert rule's metrics exist and every rule
    evaluates cleanly. Shared by `scrape` (loopback) and compose_test.py (the compose stack).
    Returns the dashboard's metric names."""
    names = sorted({n for _, e in dashboard_queries()
                    for n in re.findall(r"\bkvq_[a-z0-9_]+", e)})
    if len(names) < 15:
        fail(f"the dashboard names only {len(names)} kvq metrics")

    def all_names_present():
        missing = []
        for n in names:
            res = prom_query(base, f'count({{__name__="{n}"}})')
            if not res.get("data", {}).get("result"):
                missing.append(n)
        return (not missing, missing)

    wait_until("dashboard metrics missing from the kvq scrape", all_names_present, 60, logs)

    def all_queries_answer():
        empty = []
        for title, e in dashboard_queries():
            if e.startswith("label_values("):
                m = re.match(r"label_values\((\w+),\s*(\w+)\)", e)
                res = prom_query(base, f"count by ({m.group(2)}) ({m.group(1)})")
            else:
                res = prom_query(base, substitute(e))
            if res.get("status") != "success":
                fail(f"panel {title!r}: query {e!r} is not valid PromQL: {res.get('error')}")
            if not res["data"]["result"]:
                empty.append(f"{title}: {e}")
        return (not empty, empty)

    wait_until("dashboard queries with no data", all_queries_answer, 60, logs)
    # Every alert's metrics exist too, and each rule evaluates without error.
    alerts = open(os.path.join(DEPLOY, "prometheus", "alerts.yml")).read()
    missing = [n for n in sorted(set(re.findall(r"\bkvq_[a-z0-9_]+", alerts)))
               if not prom_query(base, f'count({{__name__="{n}"}})')["data"]["result"]]
    if missing:
        fail(f"alert rules use metrics kvq does not export: {missing}")

    def rules_healthy():
        groups = http_json(f"{base}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        bad = [(r["name"], r.get("health"), r.get("lastError")) for r in rules
               if r.get("health") != "ok"]
        return (len(rules) >= 7 and not bad, bad or f"{len(rules)} rules loaded")

    wait_until("alert rules not evaluating cleanly", rules_healthy, 60, logs)
    def tenant_series():
        res = prom_query(base, f'kvq_tenant_stored_bytes{{tenant="{tenant}"}}')
        return (bool(res["data"]["result"]), res["data"]["result"])

    # Waited for: the queries above may all answer (from other traffic) before the scrape
    # that first sees this tenant.
    wait_until("no per-tenant series for the load's tenant", tenant_series, 60, logs)
    return names


def check_scrape(args):
    prometheus = need("prometheus")
    promtool = need("promtool")
    tmp = tempfile.mkdtemp(prefix="kvq-deploy-")
    procs = []
    logs = []
    try:
        server_log = os.path.join(tmp, "kvq-server.log")
        logs.append(("kvq-server", server_log))
        server = subprocess.Popen(
            [args.server_bin, "--grpc-address", "127.0.0.1", "--grpc-port", "0",
             "--metrics-address", "127.0.0.1", "--metrics-port", "0",
             "--registry", os.path.join(tmp, "registry"), "--capacity", "1G"],
            stdout=subprocess.DEVNULL, stderr=open(server_log, "w"))
        procs.append(server)

        # Both ports chosen by the server (port 0) and read from its log: a port picked here and
        # bound later could be taken in between by another process.
        def server_ports():
            m = re.search(r"serving gRPC on 127\.0\.0\.1:(\d+); metrics on 127\.0\.0\.1:(\d+)/metrics",
                          open(server_log).read())
            if server.poll() is not None:
                fail(f"kvq-server exited with {server.returncode}")
            return (m is not None, (int(m.group(1)), int(m.group(2))) if m else None)

        grpc_port, metrics_port = wait_until("kvq-server did not start", server_ports, 60, logs)
        addr = f"127.0.0.1:{grpc_port}"

        # Traffic for every series the dashboard shows: all methods, a tenant, an error code.
        r = run([args.load_bin, "--server", addr, "--tenant", "dash-tenant", "--requests", "120",
                 "--concurrency", "2", "--context", "96", "--layers", "2", "--q-heads", "4",
                 "--kv-heads", "2", "--head-dim", "64", "--basis-rank", "8", "--keep",
                 "--mix", "attend:2,put:1,score:1,readout:1", "--baseline", "noop",
                 "--progress", "0"], timeout=300)
        if r.returncode != 0:
            fail(f"kvq-load: exit {r.returncode}: {r.stdout}{r.stderr}")
        r = run([args.kvq_bin, "seq", "delete", "no-such-sequence", "--server", addr], timeout=60)
        if r.returncode != 15:
            fail(f"kvq seq delete of a missing sequence: exit {r.returncode}, want 15 (NOT_FOUND)")

        cfg = os.path.join(tmp, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "rule_files:\n  - alerts.yml\n"
                    "scrape_configs:\n  - job_name: kvq\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{metrics_port}']\n")
        shutil.copy(os.path.join(DEPLOY, "prometheus", "alerts.yml"),
                    os.path.join(tmp, "alerts.yml"))
        r = run([promtool, "check", "config", cfg])
        if r.returncode != 0:
            fail(f"promtool on the test config: {r.stdout}{r.stderr}")
        prom_log = os.path.join(tmp, "prometheus.log")
        logs.append(("prometheus", prom_log))
        # Prometheus cannot report a port it chose, so a free one is picked here; when another
        # process takes it first, Prometheus exits at once ("address already in use") and is
        # started again on another (3 tries).
        for attempt in range(3):
            prom_port = free_port()
            prom = subprocess.Popen(
                [prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/tsdb",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=subprocess.DEVNULL, stderr=open(prom_log, "w"))
            procs.append(prom)
            time.sleep(1.0)
            if prom.poll() is None or "address already in use" not in open(prom_log).read():
                break
        base = f"http://127.0.0.1:{prom_port}"

        def target_up():
            try:
                res = prom_query(base, 'up{job="kvq"}')
            except OSError as e:
                return False, str(e)
            vals = res.get("data", {}).get("result", [])
            return (bool(vals) and vals[0]["value"][1] == "1", vals)

        wait_until("Prometheus never scraped kvq-server (up != 1)", target_up, 90, logs)

        names = check_dashboard_and_rules(base, "dash-tenant", logs)
        print(f"scrape: OK ({len(names)} metrics, {len(dashboard_queries())} queries)")

        # Graceful shutdown: SIGTERM, exit 0.
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fail("kvq-server did not stop within 30 s of SIGTERM")
        if code != 0:
            fail(f"kvq-server exited {code} on SIGTERM")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=["compose", "promtool", "manifests", "haproxy", "scrape"])
    ap.add_argument("--server-bin")
    ap.add_argument("--load-bin")
    ap.add_argument("--kvq-bin")
    args = ap.parse_args()
    if args.check == "compose":
        check_compose()
    elif args.check == "promtool":
        check_promtool()
    elif args.check == "manifests":
        check_manifests()
    elif args.check == "haproxy":
        check_haproxy()
    else:
        if not (args.server_bin and args.load_bin and args.kvq_bin):
            ap.error("scrape needs --server-bin, --load-bin and --kvq-bin")
        check_scrape(args)


if __name__ == "__main__":
    main()
