"""Scale-out through HAProxy on loopback: three kvq-server shards behind the shipped router
configuration (deploy/haproxy/haproxy.cfg, its settings from the environment), reached by
the Python client in router mode (and by the C++ CLI with --router).

* affinity: 10,000 sequences written through the router are each held by exactly one shard,
  and every read through the router finds its own sequence's data;
* a call without x-kvq-route is refused by the router with INVALID_ARGUMENT;
* one shard killed (SIGKILL): only its sequences fail, with UNAVAILABLE until HAProxy marks
  it down, NOT_FOUND after (its keys moved to the other shards, which do not hold them);
  the time until then is bounded by the check settings; the other sequences never fail;
* the frontend re-puts the failed sequences (they land on the shards that took the keys);
* the shard restarted (empty: kvq keeps sequences in memory): once HAProxy marks it up its
  keys move back, reads find nothing there (NOT_FOUND, never the copies the other shards
  took over) until the frontend re-puts them; no read ever returns another sequence's data
  or a stale version;
* another shard frozen (SIGSTOP), not killed: marked down, its sequences re-put on the
  shards that took its keys and appended to there; thawed (SIGCONT), it drops its copies on
  the router's first probe after the gap (--drop-after-probe-gap) and answers it 503, so
  that once HAProxy marks it up again a read of those sequences returns the new data or
  NOT_FOUND, never the copy it held before it froze.

Every sequence's data says who it is and which version it is: its tokens (1..10, +10 per
re-put) and the constant its values hold; Attend over equal keys returns that constant.
Needs haproxy (scripts/install-deps.sh installs it): the test fails without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Tuple

import grpc
import numpy as np
import pytest

import kvq
from kvq._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc

from conftest import REPO, ServerProcess, register_tiny, start_server

N = 10_000
D = 64
TENANT = "acme"
# Check settings of the test (the shipped defaults are slower: 2s/500ms/2/3, 1s timeout).
INTER, FASTINTER, FALL, RISE, CHECK_TIMEOUT = 0.5, 0.5, 2, 2, 0.3
# --drop-after-probe-gap of the shards: above INTER (the gap between probes while a shard
# is up), below INTER + (FALL - 1) * FASTINTER (the shortest gap after which HAProxy can have
# marked a running shard down), with 0.25 s of margin either way for a loaded test machine.
PROBE_GAP = INTER + (FALL - 1) * FASTINTER / 2
assert INTER < PROBE_GAP < INTER + (FALL - 1) * FASTINTER
DROP_FLAG = ("--drop-after-probe-gap", f"{int(PROBE_GAP * 1000)}ms")
# When a killed shard's port refuses connections, it is marked down at most
# INTER + (FALL - 1) * FASTINTER after the kill (a check times out only on a silent peer:
# FALL * CHECK_TIMEOUT more). The slack covers a loaded test machine.
DOWN_BOUND = INTER + (FALL - 1) * FASTINTER + FALL * CHECK_TIMEOUT
UP_BOUND = INTER + (RISE - 1) * INTER
SLACK = 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens_of(i: int, version: int) -> int:
    return 1 + i // 1000 + 10 * (version - 1)


def value_of(i: int) -> float:
    return (i % 1000) / 8.0 - 62.5  # exact in float16


def sid(i: int) -> str:
    return f"conv-{i}"


def more(ids: List[int], version: int, n: int) -> List[kvq.Append]:
    """n more tokens of each sequence's value, after the tokens of `version`."""
    out = []
    for i in ids:
        k = np.zeros((1, n, D), np.float16)
        v = np.full((1, n, D), value_of(i), np.float16)
        out.append(kvq.Append(sid(i), 0, tokens_of(i, version), k, v))
    return out


def appends(ids: List[int], version: int) -> List[kvq.Append]:
    out = []
    for i in ids:
        t = tokens_of(i, version)
        k = np.zeros((1, t, D), np.float16)
        v = np.full((1, t, D), value_of(i), np.float16)
        out.append(kvq.Append(sid(i), 0, 0, k, v, model="tiny"))
    return out


QUERY = np.zeros((1, 1, D), np.float32)


def read(client: kvq.Client, ids: List[int]) -> List[kvq.ItemResult]:
    return client.attend([kvq.AttendItem(sid(i), 0, QUERY, observe=False) for i in ids],
                         check=False)


def check_data(ids: List[int], results: List[kvq.ItemResult], version_of, more_of=None) -> None:
    """Every OK result is its own sequence's data at the version expected (plus more_of(i)
    tokens appended to it)."""
    for i, r in zip(ids, results):
        if not r.ok:
            continue
        want_tokens = tokens_of(i, version_of(i)) + (more_of(i) if more_of else 0)
        assert r.tokens == want_tokens, f"{sid(i)}: {r.tokens} tokens, expected {want_tokens}"
        assert np.allclose(r.outputs, value_of(i), atol=1e-2), f"{sid(i)}: another's data"


class Router:
    """haproxy -db on the shipped configuration, on loopback ports."""

    def __init__(self, workdir: Path, shards: List[ServerProcess]) -> None:
        binary = shutil.which("haproxy")
        if binary is None:
            pytest.fail("haproxy is not installed: run scripts/install-deps.sh")
        self.port, self.stats_port = free_port(), free_port()
        env = dict(os.environ)
        env.update({
            "KVQ_ROUTER_BIND": f"127.0.0.1:{self.port}",
            "KVQ_ROUTER_STATS_BIND": f"127.0.0.1:{self.stats_port}",
            "KVQ_ROUTER_CHECK_INTER": f"{int(INTER * 1000)}ms",
            "KVQ_ROUTER_CHECK_FASTINTER": f"{int(FASTINTER * 1000)}ms",
            "KVQ_ROUTER_CHECK_FALL": str(FALL),
            "KVQ_ROUTER_CHECK_RISE": str(RISE),
            "KVQ_ROUTER_TIMEOUT_CHECK": f"{int(CHECK_TIMEOUT * 1000)}ms",
        })
        for n, s in enumerate(shards):
            env[f"KVQ_SHARD_{n}"] = s.address
            env[f"KVQ_SHARD_{n}_METRICS_PORT"] = str(s.metrics_port)
        self.log_path = workdir / "haproxy.log"
        cfg = REPO / "deploy/haproxy/haproxy.cfg"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log,
                                         stderr=subprocess.STDOUT, env=env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def states(self) -> Dict[str, str]:
        """Shard name (kvq-0..2) -> HAProxy's status (UP, DOWN, "UP 1/2", ...)."""
        url = f"http://127.0.0.1:{self.stats_port}/stats;csv"
        rows = urllib.request.urlopen(url, timeout=2).read().decode().splitlines()
        head = rows[0].lstrip("# ").split(",")
        out = {}
        for row in rows[1:]:
            f = dict(zip(head, row.split(",")))
            if f.get("pxname") == "kvq_shards" and f.get("svname", "").startswith("kvq-"):
                out[f["svname"]] = f["status"]
        return out

    def wait(self, pred, what: str, timeout: float = 15.0) -> float:
        """Polls the states until pred(states) holds; returns the monotonic time it did."""
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"haproxy exited:\n{self.log_path.read_text()}")
            try:
                if pred(self.states()):
                    return time.monotonic()
            except OSError:
                pass
            if time.monotonic() > end:
                pytest.fail(f"router: {what} not reached: {self.states()}\n"
                            f"{self.log_path.read_text()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cluster(kvq_server_factory, tmp_path):
    """Three shards with /healthz on fixed metrics ports (kept across a restart), the model
    registered on each directly, and the router in front of them."""
    shards = [kvq_server_factory("--metrics-port", str(free_port()), *DROP_FLAG,
                                 name=f"shard{n}", metrics=True) for n in range(3)]
    with kvq.Client([s.address for s in shards], tenant=TENANT, deadline=10) as direct:
        register_tiny(direct, layers=1, kv_heads=1, q_heads=1, head_dim=D)
    router = Router(tmp_path, shards)
    try:
        router.wait(lambda st: len(st) == 3 and all(v == "UP" for v in st.values()),
                    "every shard UP")
        yield shards, router
    finally:
        router.stop()


def owners(shards: List[ServerProcess], ids: List[int]) -> Dict[int, List[int]]:
    """Shard index -> the ids it holds, asked of each shard directly (one batched call)."""
    out = {}
    for n, s in enumerate(shards):
        if s.proc.poll() is not None:
            continue
        with kvq.Client(s.address, tenant=TENANT, deadline=30) as one:
            res = [r for k in range(0, len(ids), 4000) for r in read(one, ids[k:k + 4000])]
        for r in res:
            assert r.ok or r.code == grpc.StatusCode.NOT_FOUND, r
        out[n] = [i for i, r in zip(ids, res) if r.ok]
    return out


def cli(kvq_build_dir: Path, router: Router, *args: str) -> Tuple[int, str]:
    r = subprocess.run([str(kvq_build_dir / "bin/kvq"), "--server", router.address, "--router",
                        "--tenant", TENANT, "--timeout", "5s", *args],
                       capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout + r.stderr


def test_router_affinity_failover_and_return(cluster, kvq_build_dir, tmp_path):
    shards, router = cluster
    ids = list(range(N))
    t_start = time.monotonic()

    # A call without the routing header is refused by the router itself.
    with grpc.insecure_channel(router.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            kvq_pb2_grpc.KvqStub(ch).Echo(kvq_pb2.EchoRequest(payload=b"x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "x-kvq-route" in e.value.details()

    with kvq.Client(router.address, router=True, tenant=TENANT, deadline=10) as rc:
        # -- affinity --------------------------------------------------------------------------
        put = rc.put_blocks(appends(ids, 1))
        assert put.appends == N
        t_put = time.monotonic()
        held = owners(shards, ids)
        counts = [len(held[n]) for n in range(3)]
        print(f"\nrouter: {N} sequences written in {t_put - t_start:.1f}s; per shard {counts}")
        assert sum(counts) == N, "every sequence on exactly one shard"
        assert all(c > 0 for c in counts), counts
        owner = {i: n for n, held_ids in held.items() for i in held_ids}
        assert len(owner) == N
        res = read(rc, ids)
        assert all(r.ok for r in res), [r for r in res if not r.ok][:3]
        check_data(ids, res, lambda i: 1)
        print(f"router: {N} reads through the router in {time.monotonic() - t_put:.1f}s")
        # The C++ client (the kvq CLI) computes the same keys, so HAProxy sends it to the
        # same shard: it finds sequences the Python client wrote.
        for i in ids[:: N // 5]:
            rc_, out = cli(kvq_build_dir, router, "seq", "get", sid(i), str(tmp_path / "s.kvq"))
            assert rc_ == 0 and f"{tokens_of(i, 1)} tokens in layer 0" in out, out
            rc_, out = cli(kvq_build_dir, router, "seq", "shard", sid(i))
            assert rc_ == 0 and out.strip() == rc.route_key(sid(i)), out

        # -- one shard killed --------------------------------------------------------------------
        victim = 1
        lost = held[victim]
        kept = [i for i in ids if owner[i] != victim]
        probe_ids = lost[:40] + kept[:40]
        with kvq.Client(router.address, router=True, tenant=TENANT, deadline=2,
                        max_attempts=1) as probe:
            read(probe, probe_ids)  # connections to the router are open
            shards[victim].kill()
            t_kill = time.monotonic()
            first_unavailable = down_seen = None
            while time.monotonic() - t_kill < DOWN_BOUND + SLACK + 3:
                res = read(probe, probe_ids)
                now = time.monotonic() - t_kill
                lost_codes = {r.code for r in res[:40]}
                assert all(r.ok for r in res[40:]), "a sequence of a live shard failed"
                assert lost_codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND}
                check_data(probe_ids, res, lambda i: 1)
                if grpc.StatusCode.UNAVAILABLE in lost_codes and first_unavailable is None:
                    first_unavailable = now
                if lost_codes == {grpc.StatusCode.NOT_FOUND}:
                    down_seen = now
                    break
        t_marked = router.wait(lambda st: st["kvq-1"].startswith("DOWN"), "kvq-1 DOWN")
        print(f"router: shard killed; its {len(lost)} sequences failed with UNAVAILABLE "
              f"(first at {first_unavailable or 0:.2f}s), NOT_FOUND from {down_seen or 0:.2f}s "
              f"after the kill; HAProxy DOWN at {t_marked - t_kill:.2f}s "
              f"(bound {DOWN_BOUND:.2f}s)")
        assert down_seen is not None, "the lost sequences never moved to the other shards"
        assert down_seen <= DOWN_BOUND + SLACK
        # Every sequence: the lost ones NOT_FOUND, the others intact.
        res = read(rc, ids)
        for i, r in zip(ids, res):
            want = grpc.StatusCode.NOT_FOUND if owner[i] == victim else grpc.StatusCode.OK
            assert r.code == want, (sid(i), r.code, r.message)
        check_data(ids, res, lambda i: 1)

        # -- the frontend re-puts the lost sequences (version 2) ---------------------------------
        rc.put_blocks(appends(lost, 2))
        version = {i: (2 if owner[i] == victim else 1) for i in ids}
        res = read(rc, ids)
        assert all(r.ok for r in res)
        check_data(ids, res, version.get)
        took = owners(shards, lost)
        assert sum(len(v) for v in took.values()) == len(lost) and victim not in took

        # -- the shard returns, empty -------------------------------------------------------------
        old = shards[victim]
        restarted = restart(old)
        shards[victim] = restarted
        try:
            t_serving = time.monotonic()
            t_up = router.wait(lambda st: st["kvq-1"] == "UP", "kvq-1 UP again")
            print(f"router: shard back; UP {t_up - t_serving:.2f}s after SERVING "
                  f"(bound {UP_BOUND:.2f}s)")
            assert t_up - t_serving <= UP_BOUND + SLACK
            # Its keys are back on it: reads find nothing there, never the copies the other
            # shards took over (version 2 is stale from now on).
            res = read(rc, lost)
            assert all(r.code == grpc.StatusCode.NOT_FOUND for r in res), \
                [(r.code, r.tokens) for r in res if r.code != grpc.StatusCode.NOT_FOUND][:5]
            rc.put_blocks(appends(lost, 3))
            for i in lost:
                version[i] = 3
            res = read(rc, ids)
            assert all(r.ok for r in res)
            check_data(ids, res, version.get)
            now_held = owners(shards, ids)
            assert sorted(now_held[victim]) == sorted(lost)
            orphans = sum(len(now_held[n]) for n in range(3)) - N
            print(f"router: after the return, per shard {[len(now_held[n]) for n in range(3)]}; "
                  f"{orphans} copies of version 2 left on the other shards, never read "
                  f"(sequence TTL drops them); total {time.monotonic() - t_start:.1f}s")
            assert orphans == len(lost)
            frozen_phase(rc, shards, router, owner, version)
            print(f"router: whole test {time.monotonic() - t_start:.1f}s")
        finally:
            restarted.stop()


def probe_gap_drops(shard: ServerProcess) -> int:
    url = f"http://127.0.0.1:{shard.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return int(float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("kvq_probe_gap_drops_total "))))


def frozen_phase(rc: kvq.Client, shards: List[ServerProcess], router: Router,
                 owner: Dict[int, int], version: Dict[int, int]) -> None:
    """A shard frozen (SIGSTOP), not killed, keeps its copies while HAProxy sends its keys
    elsewhere; thawed, it must never serve them again."""
    frozen = 2
    name = f"kvq-{frozen}"
    moved = [i for i in version if owner[i] == frozen]
    assert moved and all(version[i] == 1 for i in moved)
    assert [probe_gap_drops(s) for s in shards] == [0, 0, 0], "a drop without a gap"
    proc = shards[frozen].proc
    proc.send_signal(signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        t_down = router.wait(lambda st: st[name].startswith("DOWN"), f"{name} DOWN")
        # Its keys are elsewhere now: NOT_FOUND there; re-put (version 4) and appended to
        # (5 tokens more), as a frontend would go on with the conversation.
        res = read(rc, moved)
        assert all(r.code == grpc.StatusCode.NOT_FOUND for r in res), \
            [(r.code, r.tokens) for r in res if r.code != grpc.StatusCode.NOT_FOUND][:5]
        rc.put_blocks(appends(moved, 4))
        rc.put_blocks(more(moved, 4, 5))
        for i in moved:
            version[i] = 4
        res = read(rc, moved)
        assert all(r.ok for r in res)
        check_data(moved, res, version.get, lambda i: 5)
    finally:
        proc.send_signal(signal.SIGCONT)
    t_cont = time.monotonic()
    t_up = router.wait(lambda st: st[name] == "UP", f"{name} UP again")
    # Its keys are back on it. A read gets the new data (had some router still sent it to
    # the shard that took it over) or NOT_FOUND (the shard dropped its copies), never the
    # copy of version 1 it held when it froze (check_data: the token count tells).
    res = read(rc, moved)
    check_data(moved, res, version.get, lambda i: 5)
    codes = {r.code for r in res}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND}, codes
    drops = [probe_gap_drops(s) for s in shards]
    print(f"router: shard {frozen} frozen; DOWN {t_down - t_stop:.2f}s after SIGSTOP; thawed, "
          f"UP {t_up - t_cont:.2f}s after SIGCONT; reads of its {len(moved)} moved sequences: "
          f"{sum(r.ok for r in res)} new data, "
          f"{sum(r.code == grpc.StatusCode.NOT_FOUND for r in res)} NOT_FOUND, 0 stale; "
          f"probe-gap drops per shard {drops}")
    assert drops == [0 if n != frozen else 1 for n in range(3)], drops
    # The frontend re-puts what was not found (version 5): every sequence reads back right.
    lost = [i for i, r in zip(moved, res) if not r.ok]
    if lost:
        rc.put_blocks(appends(lost, 5))
    for i in lost:
        version[i] = 5
    res = read(rc, list(version))
    assert all(r.ok for r in res)
    check_data(list(version), res, version.get, lambda i: 5 if version[i] == 4 else 0)


def restart(old: ServerProcess) -> ServerProcess:
    """The same shard again: same ports, same registry (the model), an empty store."""
    workdir = old.log_path.parent / "restarted"
    binary = Path(old.args[0])
    s = start_server(binary, workdir, "--metrics-port", str(old.metrics_port), "--registry",
                     str(old.registry), *DROP_FLAG, metrics=True, port=old.port)
    assert s.port == old.port and s.metrics_port == old.metrics_port
    return s
