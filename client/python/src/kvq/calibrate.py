"""kvq-calibrate-hf / python -m kvq.calibrate: the command line of kvq.hf.calibration.calibrate
(HeadQ calibration of a transformers checkpoint; needs the [hf] extra: torch, transformers).

Exit status: 0 written (and registered when asked), 2 a bad option or input (argparse's and
CalibrationError: the message names the option), 3 a model kvq does not serve (the message
names the feature), 4 the registration failed (the server's status).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Optional

__all__ = ["calibrate", "main"]

_EPILOG = """\
The basis is the top-R eigenvectors of each (layer, KV head)'s uncentred second moment of the
post-RoPE queries E[q q^T] (all query heads of a group pooled), as kvq-calibrate fits it, in the
channel order transformers computes in (manifest channel_order "hf", rope_layout "halves" for
rotate_half models): register it with --register or kvq.hf.register_basis, never mapped again.
Calibrate on text the evaluation does not use (wiki.valid.tokens; wiki.test.raw is refused).
Refused (exit 3, naming the feature): sliding-window, chunked or linear-attention layers,
attention logit soft-capping, MLA, cross-layer KV sharing, non-RoPE positions, encoder-decoder.
Without --bits no codec is chosen (no codec.json): the server serves the entry with its
default codec. --bits B[,B2..] chooses it as kvq-calibrate --bits does (kvq/hf/codec_choice.py;
the candidate list, lever stages and criterion are codec_search.cc's, and a test holds the two
lists equal): first the key lever (none, metric rounding, + the oblique pair, + keys rotated
by H) on the probe codec headq-kv2-g128, then whether
four fp16 sinks lower the probe's perplexity, then whether dense-and-sparse lowers it by >= 1%;
then every candidate with those levers (kvq-eval config names, from about 2.4 to 9 bits per
element at head_dim 64) within the budget: (K bits + V bits) / 2, steady state, every byte
counted, the sinks' fp16 rows at --search-window-len tokens. Each is evaluated in-process
(kvq's native codec, the server's blocks byte for byte, decode-faithful: the model attends over
K/V encoded and decoded as kvq serves them) by perplexity on --search-windows windows of
--search-window-len tokens of --text that follow the calibration tokens (llama.cpp's protocol:
the second half of each window scored). The lowest perplexity wins, but perplexities within
0.5% of the lowest are near-ties and the fewest bits among them win (then the earlier row), so
that noise in the arithmetic does not flip the choice (kvq-calibrate applies the same rule).
Writes DIR/codec.json (the chosen codec, the registry's format) and DIR/codec-search.json (every
row, each budget's choice) and prints the tables; --register then sends codec.json with the
basis. More budgets (--bits 3,2.5,4) are chosen from the same rows (candidates up to the
largest); codec.json gets the first one's. Check a row: python -m kvq.hf.codec_choice.
The oblique pair (--oblique, implied by --bits) is kvq-calibrate's reduced-rank regression of
the score error against the keys' 2-bit G=32 KIVI residual (encode basis A, decode basis B),
written to DIR/oblique; when --bits chooses it, DIR serves with it and the query PCA moves to
DIR/query-pca, as kvq-calibrate does.
Exit: 0 written (and registered), 2 a bad option or input (named), 3 a refused model, 4 the
server of --register not SERVING (checked before calibrating) or the registration failed.
"""


def calibrate(*args: Any, **kwargs: Any) -> Any:
    """kvq.hf.calibration.calibrate (imported on call: the client itself needs no torch);
    returns its CalibrationResult."""
    from .hf.calibration import calibrate as run

    return run(*args, **kwargs)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvq-calibrate-hf",
        description="HeadQ query-PCA calibration of a transformers checkpoint (a folder, a hub id "
                    "or a .gguf file), written as a kvq registry entry (manifest.json + "
                    "basis.safetensors, the layout kvq-calibrate writes).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint folder, hub id, or .gguf file (loaded with gguf_file=)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="DIR", help="the entry folder to write (as kvq-calibrate --out)")
    where.add_argument("--registry", metavar="DIR",
                       help="a registry folder: writes DIR/<model-name>/v<version> (kvq-server --registry)")
    p.add_argument("--text", metavar="FILE",
                   help="calibration text, used verbatim (default $KVQ_DATA_DIR/wikitext-2/wiki.valid.tokens, "
                        "KVQ_DATA_DIR default ../shared/data)")
    p.add_argument("--tokens", type=int, default=32768, help="calibration tokens from the start of the text (32768)")
    p.add_argument("--rank", type=int, default=8, help="basis rank (8; the codec may use the first r <= R columns)")
    p.add_argument("--window-len", type=int, default=512, help="tokens per independent window (512)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass (4): memory ~ batch x window-len")
    p.add_argument("--model-name", help="manifest model name (default: the file or folder name, lower case, "
                                        "without .gguf and its quantization tag, + '-hf')")
    p.add_argument("--version", type=int, default=1, help="basis version (1)")
    p.add_argument("--centred", action="store_true", help="fit the covariance (kind query_pca_centred), an ablation")
    p.add_argument("--oblique", action="store_true",
                   help="also fit the oblique pair into DIR/oblique (implied by --bits; see below)")
    p.add_argument("--no-query-moment", action="store_true",
                   help="store U alone, without each head's E[q q^T] (then no metric rounding)")
    p.add_argument("--gguf-file", help="the GGUF file inside the model folder (instead of MODEL ending in .gguf)")
    p.add_argument("--device", default="cpu", help="torch device of the forward passes (cpu)")
    p.add_argument("--dtype", default="float32", help="torch dtype of the weights and activations (float32)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--register", metavar="ADDRESS", help="also register the entry with the kvq-server at ADDRESS")
    p.add_argument("--bits", metavar="B[,B2..]",
                   help="also choose the codec within B bits per element, K and V together (see below); "
                        "more budgets are chosen from the same evaluation, codec.json gets the first")
    p.add_argument("--search-windows", type=int, default=8, help="windows of the codec search (8)")
    p.add_argument("--search-window-len", type=int, default=512, help="tokens per search window (512)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from .errors import KvqError
    from .hf.basis import BasisOrderError
    from .hf.calibration import CalibrationError
    from .hf.support import UnsupportedModelError

    if args.threads is not None:
        if args.threads < 1:
            print(f"kvq-calibrate-hf: --threads: {args.threads}: must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    budgets = None
    if args.bits is not None:
        try:
            budgets = [float(b) for b in args.bits.split(",") if b.strip()]
        except ValueError:
            budgets = []
        if not budgets or not all(b > 0 for b in budgets):
            print(f"kvq-calibrate-hf: --bits: '{args.bits}': must be positive numbers of bits per element, "
                  "comma-separated", file=sys.stderr)
            return 2
    try:
        r = calibrate(args.model, out=args.out, registry=args.registry, text=args.text, tokens=args.tokens,
                      rank=args.rank, window_len=args.window_len, batch=args.batch,
                      model_name=args.model_name, version=args.version, centred=args.centred,
                      query_moment=not args.no_query_moment, gguf_file=args.gguf_file,
                      device=args.device, dtype=args.dtype, register=args.register,
                      progress=not args.quiet, bits=budgets, search_windows=args.search_windows,
                      search_window_len=args.search_window_len, oblique=args.oblique)
    except UnsupportedModelError as e:
        print(f"kvq-calibrate-hf: {e}", file=sys.stderr)
        return 3
    except CalibrationError as e:
        option = "MODEL" if e.field == "model" else "--" + e.field.replace("_", "-").replace("/", "/--")
        print(f"kvq-calibrate-hf: {option}: {e.message}", file=sys.stderr)
        return 2
    except (KvqError, BasisOrderError) as e:
        # calibrate() checks the server first, and registers only after writing the entry.
        print(f"kvq-calibrate-hf: --register {args.register}: {e}", file=sys.stderr)
        return 4
    energy = r.captured_energy
    print(f"kvq-calibrate-hf: wrote {r.path} ({r.manifest['kind']}, rank {r.manifest['rank']}, "
          f"mean captured query energy {energy.mean():.3f}, min {energy.min():.3f}; "
          f"{r.manifest['calibration_tokens']} tokens in {r.seconds:.1f} s after a {r.load_seconds:.1f} s load, "
          f"peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB)", file=sys.stderr)
    if r.codec is not None:
        c = r.codec.chosen
        print(f"kvq-calibrate-hf: chose {c.name} ({c.codec}, {c.bits:.3f} bits per element, validation PPL "
              f"{c.ppl:.4f}) in {r.codec.seconds:.1f} s: wrote {r.path}/codec.json and {r.path}/codec-search.json",
              file=sys.stderr)
    if r.registered is not None:
        print(f"kvq-calibrate-hf: registered {r.registered.model} v{r.registered.version} at {args.register}",
              file=sys.stderr)
    out = {"path": r.path, "manifest": r.manifest}
    if r.codec is not None:
        out["codec"] = {"chosen": r.codec.chosen.name, "budgets": r.codec.budgets}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
