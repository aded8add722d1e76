"""kvq.ring.HashRing is the C++ client's ring (client/lib/src/hash_ring.cc): 10,000 sequence
ids (several tenants, ids with and without {tags}) get the same server from both. The C++ side
is `kvq seq shard`, which prints the server kvq::client::Client::ShardOf picks."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
import xxhash

import kvq
from kvq.ring import HashRing, hash_tag, key_of


def test_hash_tag_rule():
    assert hash_tag("{sys-7}conv-1") == b"sys-7"
    assert hash_tag("a{b}c{d}") == b"b"          # the first '{' and the next '}'
    assert hash_tag("x{}y") == b"x{}y"           # empty tag: the whole id
    assert hash_tag("x{y") == b"x{y"             # no closing brace
    assert hash_tag("x}y{z}") == b"z"            # a '}' before the first '{' does not count
    assert hash_tag("plain") == b"plain"
    assert hash_tag("{é}") == "é".encode()


def test_key_is_xxh3_of_tenant_nul_tag():
    assert key_of("t", "{a}b") == xxhash.xxh3_64_intdigest(b"t\0a")
    assert key_of("ab", "c") != key_of("a", "bc")


def test_ring_does_not_depend_on_server_order():
    a = [f"kvq-{i}:50051" for i in range(5)]
    b = [a[3], a[0], a[4], a[2], a[1]]
    ra, rb = HashRing(a), HashRing(b)
    for i in range(2000):
        sid = f"seq-{i}"
        assert ra.servers[ra.shard_of("t", sid)] == rb.servers[rb.shard_of("t", sid)]


def test_load_is_nearly_even_and_adding_a_server_moves_only_to_it():
    servers = [f"kvq-{i}:50051" for i in range(4)]
    r4, r5 = HashRing(servers), HashRing(servers + ["kvq-4:50051"])
    counts = [0] * 4
    moved = 0
    for i in range(20000):
        sid = f"seq-{i}"
        before, after = r4.shard_of("t", sid), r5.shard_of("t", sid)
        counts[before] += 1
        if before != after:
            moved += 1
            assert after == 4
    assert all(0.75 * 5000 < c < 1.25 * 5000 for c in counts), counts
    assert 0.1 * 20000 < moved < 0.3 * 20000, moved


def test_client_shard_key_uses_tenant_then_token_then_default():
    servers = ["a:1", "b:2", "c:3"]
    ring = HashRing(servers)
    ids = [f"s{i}" for i in range(200)]
    for kwargs, tenant in [({"tenant": "acme"}, "acme"), ({}, "default"),
                           ({"token": "tok-0123456789abcdef", "allow_insecure_token": True},
                            "tok-0123456789abcdef")]:
        with kvq.Client(servers, **kwargs) as c:
            assert [c.shard_of(s) for s in ids] == [ring.shard_of(tenant, s) for s in ids]


def ids_for_parity(n: int):
    rng = random.Random(20251201)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_.:/{}"
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            sid = f"seq-{i}"
        elif kind == 1:
            sid = f"{{prompt-{rng.randrange(50)}}}conv-{i}"
        elif kind == 2:
            sid = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        elif kind == 3:
            sid = f"req/{rng.getrandbits(64):016x}/layer"
        else:
            sid = f"ü-{i}-{{}}-{{x{i % 7}}}"
        out.append(sid)
    return out


def find_kvq_cli(kvq_server_bin: Path) -> Path:
    candidates = []
    if os.environ.get("KVQ_BUILD_DIR"):
        candidates.append(Path(os.environ["KVQ_BUILD_DIR"]) / "bin/kvq")
    candidates.append(kvq_server_bin.parent / "kvq")
    for c in candidates:
        if c.is_file():
            help_text = subprocess.run([str(c), "seq", "--help"], capture_output=True, text=True).stdout
            if "seq shard" in help_text:
                return c
    pytest.fail(f"no kvq CLI with 'seq shard' in {[str(c) for c in candidates]}: build the kvq target")


@pytest.mark.parametrize("tenant", ["default", "acme", "tenant-with-a-long-name-ü"])
def test_ten_thousand_ids_match_the_cxx_ring(kvq_server_bin, tenant):
    cli = find_kvq_cli(kvq_server_bin)
    servers = ["127.0.0.1:50051", "10.0.0.2:50051", "kvq-2.kvq.default.svc:50051",
               "dns:///kvq-3:7000", "[::1]:50052"]
    ids = ids_for_parity(10000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
    r = subprocess.run([str(cli), "seq", "shard", "--server", ",".join(servers), "--tenant", tenant],
                       input="\n".join(ids) + "\n", capture_output=True, text=True, env=env, check=True)
    cxx = r.stdout.splitlines()
    assert len(cxx) == len(ids)
    ring = HashRing(servers)
    py = [servers[ring.shard_of(tenant, sid)] for sid in ids]
    mismatches = [(sid, a, b) for sid, a, b in zip(ids, py, cxx) if a != b]
    assert not mismatches, mismatches[:5]
    assert len(set(cxx)) == len(servers)  # every server got some: the comparison is not trivial
