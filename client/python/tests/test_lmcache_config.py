"""The kvq LMCache plugin's settings parser and chunk ids (no server, no LMCache engine)."""

import hashlib
import json

import pytest

from kvq import CodecSettings
from kvq.lmcache.config import PluginConfigError, parse_plugin_config
from kvq.lmcache.layout import MAX_SEQUENCE_ID_BYTES, sequence_id_for

P = "remote_storage_plugin.kvq."


def cfg(**kv):
    return {P + k: v for k, v in {"server": "127.0.0.1:5", "model": "m", **kv}.items()}


def test_minimal_settings_and_defaults():
    c = parse_plugin_config("kvq", {**cfg(), P + "module_path": "kvq.lmcache", P + "class_name": "KvqConnector",
                                    "remote_storage_plugin.other.server": "ignored"})
    assert c.servers == ("127.0.0.1:5",) and c.model == "m"
    assert c.basis_version == 0 and c.codec is None and not c.tls and c.sequence_prefix == "lmcache/"
    assert c.key("model") == P + "model"


def test_every_setting():
    codec = {"key_bits": 3, "key_group": 128, "rank": 4, "side_bits": 4, "value_bits": 2,
             "value_group": 32, "value_policy": "uniform", "window": 0}
    c = parse_plugin_config("kvq", cfg(server="a:1, b:2", basis_version="2", codec=json.dumps(codec),
                                       tenant="t", token="tok", deadline_s="2.5", sequence_prefix="x/",
                                       max_workers=8))
    assert c.servers == ("a:1", "b:2") and c.basis_version == 2
    assert c.codec == CodecSettings(**codec)
    assert (c.tenant, c.token, c.deadline_s, c.sequence_prefix, c.max_workers) == ("t", "tok", 2.5, "x/", 8)
    # A dict works as well as JSON text (LMCache's YAML gives either).
    assert parse_plugin_config("kvq", cfg(codec={"rank": 0})).codec == CodecSettings(rank=0)


def test_tls_files(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA")
    c = parse_plugin_config("kvq", cfg(tls="true", ca_file=str(ca)))
    assert c.tls and c.root_certificates == b"CA"


@pytest.mark.parametrize("settings,key,problem", [
    ({"server": ""}, "server", "required"),
    ({"model": None}, "model", "required"),
    ({"server": "a:1,b"}, "server", "'b' is not host:port"),
    ({"server": "a:99999"}, "server", "'a:99999' is not host:port"),
    ({"basis_version": -1}, "basis_version", "-1 is outside"),
    ({"basis_version": 1.5}, "basis_version", "expected an integer"),
    ({"codec": "[1]"}, "codec", "expected a JSON object"),
    ({"codec": '{"value_policy": "fancy"}'}, "codec.value_policy", "'fancy' is not one of"),
    ({"codec": '{"key_bits": "two"}'}, "codec.key_bits", "expected an integer"),
    ({"tls": "maybe"}, "tls", "expected true or false"),
    ({"ca_file": "/nonexistent/ca.pem", "tls": True}, "ca_file", "cannot read"),
    ({"deadline_s": 0}, "deadline_s", "outside"),
    ({"max_workers": 0}, "max_workers", "0 is outside 1..64"),
    ({"sequence_prefix": "x" * 65}, "sequence_prefix", "longer than 64 bytes"),
    ({"sever": "a:1"}, "sever", "unknown setting"),
])
def test_bad_settings_name_the_key(settings, key, problem):
    with pytest.raises(PluginConfigError) as e:
        parse_plugin_config("kvq", cfg(**settings))
    assert e.value.key == P + key
    assert str(e.value).startswith(f"{P}{key}: ") and problem in str(e.value)


def test_plugin_name_is_the_prefix():
    c = parse_plugin_config("kvq.b", {"remote_storage_plugin.kvq.b.server": "h:1",
                                      "remote_storage_plugin.kvq.b.model": "m"})
    assert c.key("server") == "remote_storage_plugin.kvq.b.server"
    with pytest.raises(PluginConfigError, match=r"^remote_storage_plugin\.kvq\.b\.server: required"):
        parse_plugin_config("kvq.b", cfg())


def test_sequence_ids():
    key = "Qwen/Qwen2.5-0.5B@1@0@1a2b3c4d5e6f7081@half"
    assert sequence_id_for(key, "lmcache/") == "lmcache/" + key
    long_key = "m" * 300 + "@1@0@ff@half"
    sid = sequence_id_for(long_key, "lmcache/")
    assert sid == "lmcache/sha256:" + hashlib.sha256(long_key.encode()).hexdigest()
    assert len(sid.encode()) <= MAX_SEQUENCE_ID_BYTES
    # The limit is in bytes: "p/" + 127 two-byte characters is 256 bytes and fits, 128 do not.
    assert sequence_id_for("é" * 127, "p/") == "p/" + "é" * 127
    assert sequence_id_for("é" * 128, "p/").startswith("p/sha256:")
