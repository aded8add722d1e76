"""kvq.calibrate: HeadQ calibration of a transformers checkpoint.

* the streaming statistics against a one-shot numpy fit (odd sizes, fixed seed);
* SmolLM2 (the GGUF, loaded by transformers) calibrated on a short slice of wiki.valid.tokens:
  the entry reads back (fingerprint, orthonormal columns), kvq-server takes it through
  --register and lists it with its shape, and the C++ client's `kvq models register` finds
  the very same entry (core::ReadBasis of the files);
* agreement with kvq-calibrate on the same text: per head, the held-out query energy each
  basis captures and the principal angles between them; the same for the oblique pair's
  encode and decode bases (kvq-calibrate --variants' DIR/oblique), which the server takes;
* refusals: a tiny randomly initialised model of a refused kind (sliding window, soft-capping)
  exits 3 naming the feature; bad options exit 2 naming the option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvq

from conftest import data_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvq.hf.calibration import calibrate, collect_query_stats, load_checkpoint, model_shape, read_tokens  # noqa: E402
from kvq.hf.query_stats import QueryStats, principal_angles  # noqa: E402

CALIB_TOKENS, HELD_OUT, WINDOW, RANK = 1024, 512, 256, 8


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvq.calibrate", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_streamed_stats_match_a_one_shot_fit():
    rng = np.random.default_rng(19)
    layers, q_heads, kv_heads, d, rank = 2, 6, 3, 11, 3
    # Anisotropic queries with a mean, so that centred and uncentred differ.
    scale = np.linspace(3.0, 0.2, d)
    q = rng.standard_normal((layers, 2, q_heads, 37, d)) * scale + 0.7
    stats = QueryStats(layers, q_heads, kv_heads, d)
    for layer in range(layers):
        for part in np.split(q[layer], [1], axis=0):  # two calls: the sums must stream
            stats.add(layer, torch.from_numpy(part.astype(np.float32)))
    g = q_heads // kv_heads
    for centred in (False, True):
        fitted = stats.fit(rank, centred=centred)
        assert fitted.calibration_tokens == 2 * 37
        for layer in range(layers):
            for h in range(kv_heads):
                x = q[layer][:, h * g : (h + 1) * g].reshape(-1, d).astype(np.float32).astype(np.float64)
                m = x.T @ x / len(x)
                np.testing.assert_allclose(fitted.query_moment[layer][h], m, rtol=1e-5, atol=1e-5)
                if centred:
                    mu = x.mean(0)
                    m = m - np.outer(mu, mu)
                want = np.linalg.eigh(m)[1][:, ::-1][:, :rank]
                u = fitted.u[layer][h]
                np.testing.assert_allclose(u.T @ u, np.eye(rank), atol=1e-5)
                assert principal_angles(u, want).max() < 1e-2
                # kvq-calibrate's sign convention: each column's largest entry positive.
                assert (u[np.abs(u).argmax(0), np.arange(rank)] > 0).all()
    with pytest.raises(ValueError, match="rank = 12: must be in"):
        stats.fit(12)


def test_oblique_pair_minimises_the_score_error_it_leaves():
    """fit_oblique against its definition: A^T B = I with unit decode columns, and the pair
    leaves less of the base code's score error, tr(M P Se P^T) / tr(M Se), than the query PCA
    and than random biorthogonal pairs (residuals anisotropic in other channels than the
    queries, so that the two fits differ)."""
    rng = np.random.default_rng(23)
    layers, q_heads, kv_heads, d, rank = 1, 4, 2, 12, 3
    q = rng.standard_normal((layers, 1, q_heads, 300, d)) * np.linspace(3.0, 0.2, d)
    e = rng.standard_normal((layers, kv_heads, 200, d)) * np.linspace(0.2, 2.0, d)
    stats = QueryStats(layers, q_heads, kv_heads, d)
    with pytest.raises(RuntimeError, match="no residual statistics for layer 0 kv head 0"):
        stats.add(0, torch.from_numpy(q[0].astype(np.float32)))
        stats.fit_oblique(rank)
    for part in np.split(e[0], [50], axis=1):  # two calls: the sums must stream
        stats.add_residual(0, torch.from_numpy(part))
    obl, pca = stats.fit_oblique(rank), stats.fit(rank)
    assert obl.kind == "oblique_rrr" and len(obl.encode) == layers
    a, b = obl.encode[0], obl.u[0]
    np.testing.assert_allclose(np.einsum("hdr,hds->hrs", a, b), np.broadcast_to(np.eye(rank), (kv_heads, rank, rank)),
                               atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)
    left_obl = stats.score_error_left(obl.u, obl.encode)[0]
    left_pca = stats.score_error_left(pca.u, pca.u)[0]
    assert (left_obl < left_pca - 0.05).all(), (left_obl, left_pca)
    for _ in range(5):  # random pairs: B random, A its biorthogonal dual
        rb = rng.standard_normal((kv_heads, d, rank))
        ra = np.stack([x @ np.linalg.inv(x.T @ x) for x in rb])
        assert (left_obl <= stats.score_error_left([rb], [ra])[0] + 1e-9).all()


@pytest.fixture(scope="module")
def smol_entry(smollm2_gguf, tmp_path_factory):
    """SmolLM2 calibrated through the command line (one thread, a short slice)."""
    out = tmp_path_factory.mktemp("calib") / "entry"
    r = _cli(str(smollm2_gguf), "--out", str(out), "--text", str(data_file("wikitext-2/wiki.valid.tokens")),
             "--tokens", str(CALIB_TOKENS), "--window-len", str(WINDOW), "--batch", "2", "--rank", str(RANK),
             "--threads", "1", "--oblique", "--quiet")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_calibrated_entry_loads_in_kvq_server(smol_entry, smollm2_gguf, kvq_server, kvq_build_dir):
    out, printed = smol_entry
    files = kvq.hf.read_basis(str(out))  # the fingerprint and the tensor table
    m = files.manifest
    assert m == printed["manifest"]
    assert (m["model"], m["layers"], m["kv_heads"], m["q_heads"], m["head_dim"], m["rank"]) == \
        ("smollm2-135m-instruct-hf", 30, 3, 9, 64, RANK)
    assert (m["channel_order"], m["rope_layout"], m["kind"]) == ("hf", "halves", "query_pca_uncentred")
    assert m["calibration_tokens"] == CALIB_TOKENS
    for u in files.u:
        np.testing.assert_allclose(np.einsum("hdr,hds->hrs", u, u), np.broadcast_to(np.eye(RANK), (3, RANK, RANK)),
                                   atol=1e-4)
    assert len(files.query_moment) == 30
    # Registered as kvq.hf registers it (the order is the model's: nothing is mapped).
    d, f = str(smollm2_gguf.parent), smollm2_gguf.name
    config = transformers.AutoConfig.from_pretrained(d, gguf_file=f)
    with kvq.Client(kvq_server.address, deadline=10.0) as client:
        info = kvq.hf.register_basis(client, str(out), config=config, check=False)
        assert info.model == "smollm2-135m-instruct-hf" and info.version == 1
        got = client.get_model("smollm2-135m-instruct-hf")
        assert (got.layers, got.kv_heads, got.q_heads, got.head_dim, got.basis_rank) == (30, 3, 9, 64, RANK)
        assert got.channel_order == "hf" and got.has_query_moment and got.fingerprint == m["fingerprint"]
        assert "smollm2-135m-instruct-hf" in [x.model for x in client.list_models()]
    # The C++ client reads the same folder with core::ReadBasis and finds it registered.
    r = subprocess.run([str(kvq_build_dir / "bin/kvq"), "--server", kvq_server.address, "models", "register",
                        str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "already registered smollm2-135m-instruct-hf v1" in r.stdout + r.stderr
    # The server persisted it in its registry layout.
    assert (kvq_server.registry / "smollm2-135m-instruct-hf/v1/manifest.json").is_file()
    # The oblique pair: A^T B = I per head, and the server takes it (core::ReadBasis checks the
    # biorthogonality and the fingerprint over both bases).
    obl = kvq.hf.read_basis(str(out / "oblique"))
    assert obl.manifest["kind"] == "oblique_rrr" and len(obl.encode) == 30
    for a, b in zip(obl.encode, obl.u):
        np.testing.assert_allclose(np.einsum("hdr,hds->hrs", a, b), np.broadcast_to(np.eye(RANK), (3, RANK, RANK)),
                                   atol=1e-4)
    with kvq.Client(kvq_server.address, deadline=10.0) as client:
        kvq.hf.register_basis(client, str(out / "oblique"), config=config, name="smol-oblique-hf", check=False)
        assert client.get_model("smol-oblique-hf").oblique


def test_register_flag_and_registry_layout(smollm2_gguf, kvq_server, tmp_path):
    reg = tmp_path / "registry"
    r = _cli(str(smollm2_gguf), "--registry", str(reg), "--model-name", "smol-register", "--version", "3",
             "--text", str(data_file("wikitext-2/wiki.valid.tokens")), "--tokens", "200", "--window-len", "128",
             "--rank", "4", "--threads", "1", "--register", kvq_server.address, "--quiet")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(reg / "smol-register" / "v3")
    assert "registered smol-register v3" in r.stderr
    with kvq.Client(kvq_server.address, deadline=10.0) as client:
        got = client.get_model("smol-register", 3)
    assert (got.basis_rank, got.calibration_tokens, got.channel_order) == (4, 200, "hf")
    # A server that is not there: exit 4 naming --register, before anything is calibrated.
    r = _cli(str(smollm2_gguf), "--out", str(tmp_path / "e2"), "--text", str(data_file("wikitext-2/wiki.valid.tokens")),
             "--tokens", "64", "--threads", "1", "--register", "127.0.0.1:1", "--quiet")
    assert r.returncode == 4 and "--register 127.0.0.1:1" in r.stderr and "not SERVING" in r.stderr, r.stderr
    assert not (tmp_path / "e2").exists()


def test_agrees_with_kvq_calibrate(smollm2_gguf, smol_entry, kvq_build_dir, tmp_path):
    """The same text, the same windows: the two bases span the same subspaces (the forward
    passes differ only in float rounding and GGUF dequantization order)."""
    out, _ = smol_entry
    text = str(data_file("wikitext-2/wiki.valid.tokens"))
    cpp_dir = tmp_path / "cpp"
    r = subprocess.run([str(kvq_build_dir / "bin/kvq-calibrate"), "--model", str(smollm2_gguf), "--text", text,
                        "--tokens", str(CALIB_TOKENS), "--window-len", str(WINDOW), "--rank", str(RANK),
                        "--threads", "1", "--variants", "--out", str(cpp_dir)], capture_output=True, text=True,
                        timeout=600)
    assert r.returncode == 0, r.stderr
    torch.set_num_threads(1)
    config, tok, lm = load_checkpoint(str(smollm2_gguf), None, "float32", "cpu")
    ids = read_tokens(tok, text, CALIB_TOKENS + HELD_OUT)
    shape = model_shape(config)
    assert shape == (30, 9, 3, 64)
    held = collect_query_stats(lm, ids[CALIB_TOKENS:], QueryStats(*shape), window_len=WINDOW, batch=2,
                               residuals=True)
    py = kvq.hf.read_basis(str(out)).u
    cpp = kvq.hf.to_model_order(kvq.hf.read_basis(str(cpp_dir)), config).u
    e_py, e_cpp = held.captured_energy(py), held.captured_energy(cpp)
    angles = np.array([[principal_angles(cpp[l][h], py[l][h]) for h in range(3)] for l in range(30)])
    print(f"held-out captured energy: python {e_py.mean():.4f}, kvq-calibrate {e_cpp.mean():.4f}, "
          f"max |diff| {np.abs(e_py - e_cpp).max():.2e}; principal angles: median largest "
          f"{np.median(angles[..., -1]):.3f} deg, max {angles.max():.3f} deg")
    assert np.abs(e_py - e_cpp).max() < 1e-3
    assert angles.max() < 2.0
    # One sign convention in both tools: the same columns, not only the same subspaces (without
    # it 44% of the columns came out negated, and the side code rounds differently).
    cos = np.array([[(cpp[l][h] * py[l][h]).sum(0) for h in range(3)] for l in range(30)])
    print(f"query PCA columns: cos(python, kvq-calibrate) min {cos.min():.6f}")
    assert cos.min() > 0.99
    # Not vacuous: the basis captures far more than a random rank-8 subspace would (8/64).
    assert e_py.mean() > 0.5
    # The oblique pair: the same residual code (kvq's 2-bit G=32 KIVI keys) and the same fit.
    # Its subspaces are compared by what they are fitted for, the share of the base code's
    # score error they leave on the held-out tokens: the residual flips 2-bit codes where the
    # two forward passes' keys differ in rounding, and near-degenerate directions of a
    # 1,024-token fit then turn (keys perturbed by 1e-4 of themselves move Python's own pair by
    # the same angles: median largest 2.5 deg, max 33 deg).
    py_obl = kvq.hf.read_basis(str(out / "oblique"))
    cpp_obl = kvq.hf.to_model_order(kvq.hf.read_basis(str(cpp_dir / "oblique")), config)
    left_py = held.score_error_left(py_obl.u, py_obl.encode)
    left_cpp = held.score_error_left(cpp_obl.u, cpp_obl.encode)
    left_pca = held.score_error_left(py, py)
    a = np.array([[principal_angles(cpp_obl.u[l][h], py_obl.u[l][h]) for h in range(3)] for l in range(30)])
    print(f"oblique pair, held-out score error left: python {left_py.mean():.4f}, kvq-calibrate "
          f"{left_cpp.mean():.4f}, max |diff| {np.abs(left_py - left_cpp).max():.2e} (query PCA "
          f"{left_pca.mean():.4f}); decode bases' principal angles: median largest "
          f"{np.median(a[..., -1]):.3f} deg, max {a.max():.3f} deg")
    assert np.abs(left_py - left_cpp).max() < 0.01
    # The pair's columns (the same to |cos| > 0.9) take the same sign in both tools but where
    # their two largest entries are near-equal with opposite signs and the tools' columns turn
    # by a few degrees (3 of 720 here, 0.995-0.9995 apart): the convention decides by the largest.
    cos_obl = np.array([[(cpp_obl.u[l][h] * py_obl.u[l][h]).sum(0) for h in range(3)] for l in range(30)])
    settled = np.abs(cos_obl) > 0.9
    print(f"oblique decode columns with |cos| > 0.9: {settled.mean():.0%}, of them negated: "
          f"{(cos_obl[settled] < 0).sum()} of {settled.sum()}")
    assert settled.mean() > 0.5 and (cos_obl[settled] < 0).mean() < 0.01
    # Not vacuous: the pair is not the query PCA, and leaves less of the error on unseen tokens.
    assert left_py.mean() < left_pca.mean() - 0.01


def _tiny(tmp_path: Path, name: str, config) -> str:
    """A randomly initialised model of `config`, saved (weights and config) in tmp_path."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path / name
    model.save_pretrained(str(path))
    return str(path)


_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("name,config,feature", [
    ("mistral-window", lambda: transformers.MistralConfig(sliding_window=16, **_TINY),
     "sliding-window attention (sliding_window = 16)"),
    ("gemma2", lambda: transformers.Gemma2Config(**_TINY),
     "attention logit soft-capping (attn_logit_softcapping = 50.0)"),
])
def test_refuses_features_kvq_does_not_serve(tmp_path, name, config, feature):
    path = _tiny(tmp_path, name, config())
    r = _cli(path, "--out", str(tmp_path / "entry"), "--text", str(data_file("wikitext-2/wiki.valid.tokens")),
             "--quiet")
    assert r.returncode == 3, r.stderr
    assert feature in r.stderr and "is not supported by kvq" in r.stderr
    assert not (tmp_path / "entry").exists()


def test_bad_options_name_the_option(tmp_path):
    r = _cli("unused-model", "--out", str(tmp_path / "e"), "--text", "somewhere/wiki.test.raw")
    assert r.returncode == 2 and "--text: somewhere/wiki.test.raw is the evaluation text" in r.stderr
    r = _cli("unused-model", "--out", str(tmp_path / "e"), "--rank", "0")
    assert r.returncode == 2 and "--rank: 0: must be >= 1" in r.stderr
    r = _cli("unused-model")
    assert r.returncode == 2 and "--out" in r.stderr
    r = _cli("--help")
    assert r.returncode == 0 and "--register ADDRESS" in r.stdout
    with pytest.raises(ValueError, match="out/registry: exactly one"):
        calibrate("unused-model", out="a", registry="b")


def test_default_model_name_follows_kvq_calibrate():
    from kvq.hf.calibration import default_model_name

    assert default_model_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct-hf"
    assert default_model_name("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") == "qwen2.5-coder-0.5b-instruct-hf"
    assert default_model_name("models/smollm2-135m-hf/") == "smollm2-135m-hf"
    assert default_model_name("Llama-3.2-1B") == "llama-3.2-1b-hf"
