"""The committed stubs in src/kvq/_proto are what scripts/gen-python-proto.sh generates from
proto/kvq/v1/kvq.proto with the pinned grpcio-tools (regenerated into tmp: no diff)."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "client/python/src/kvq/_proto"


def test_regenerating_the_stubs_gives_no_diff(tmp_path):
    env = dict(os.environ, KVQ_PYTHON=sys.executable)
    subprocess.run(["bash", str(REPO / "scripts/gen-python-proto.sh"), str(tmp_path)], check=True,
                   env=env, capture_output=True)
    names = ["__init__.py", "kvq/__init__.py", "kvq/v1/__init__.py", "kvq/v1/kvq_pb2.py",
             "kvq/v1/kvq_pb2.pyi", "kvq/v1/kvq_pb2_grpc.py"]
    generated = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert generated == sorted(names)
    for n in names:
        assert filecmp.cmp(tmp_path / n, COMMITTED / n, shallow=False), (
            f"{n} differs from a fresh generation: run scripts/gen-python-proto.sh and commit")


def test_the_stubs_import_inside_the_package():
    from kvq._proto.kvq.v1 import kvq_pb2, kvq_pb2_grpc

    assert kvq_pb2.DESCRIPTOR.name == "kvq/v1/kvq.proto"
    assert set(kvq_pb2.DESCRIPTOR.services_by_name["Kvq"].methods_by_name) == {
        "RegisterBasis", "ListModels", "GetModel", "GetBasis", "PutBlocks", "Score", "Readout", "Attend",
        "GetBlocks", "MatchPrefix", "DeleteSequence", "Stats", "Echo"}
    assert hasattr(kvq_pb2_grpc, "KvqStub")
    # No top-level "kvq.v1" module is needed (the service module imports relatively).
    assert "kvq.v1" not in sys.modules
