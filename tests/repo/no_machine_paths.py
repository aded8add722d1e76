#!/usr/bin/env python3
"""The repository stands alone: no tracked file names a path of one machine.

Scans every file `git ls-files` lists (text files; a file with a NUL byte is binary and passed
over) for absolute paths into a user's or a machine's own folders: home folders (root's,
the users' under /home and /Users, Windows' C:\\Users) and the /work tree of a development
machine. Paths that mean the same on every machine stay allowed: /tmp scratch defaults, /usr,
/etc, /opt, /var and container paths, $HOME or ~ instead of a home folder. Prints
FILE:LINE: TEXT for each hit and exits 1; exit 0 when clean; exit 77 (skipped) outside a git
checkout.

Usage: no_machine_paths.py [--repo DIR]   (default: the checkout this script is in)
       no_machine_paths.py --self-test     (plants a path in a scratch repository: must fail)
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# A path starts at the beginning of a line or after a character that cannot be part of a
# longer path or word ("build/work/x" and "https://host/home/x" are not machine paths).
_PATH = re.compile(r"(?:^|(?<=[\s\"'`(=:,;\[{<>|]))"
                   r"(?:/(?:root|work)/|/(?:home|Users)/[^/\s\"'`]+|[A-Za-z]:\\Users\\)")


def tracked_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], check=True,
                         capture_output=True).stdout
    return [f for f in out.decode("utf-8", "surrogateescape").split("\0") if f]


def scan(repo: Path) -> list[str]:
    hits = []
    for name in tracked_files(repo):
        path = repo / name
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if _PATH.search(line):
                text = line.strip()
                hits.append(f"{name}:{n}: {text[:160]}{'...' if len(text) > 160 else ''}")
    return hits


def self_test() -> int:
    """The check must fail on a planted path and pass once it is gone."""
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d)
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        (repo / "clean.txt").write_text("scratch in /tmp/x, $HOME/.cache and build/work/y\n")
        planted = "/" + "home/someone/data/wiki.raw"  # split: this file is scanned too
        (repo / "manifest.json").write_text('{\n  "text": "' + planted + '"\n}\n')
        subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
        hits = scan(repo)
        if hits != ['manifest.json:2: "text": "' + planted + '"']:
            print(f"self-test: the planted path was not reported as expected: {hits}")
            return 1
        (repo / "manifest.json").write_text('{\n  "text": "$KVQ_DATA_DIR/wiki.raw"\n}\n')
        if scan(repo):
            print(f"self-test: a clean tree was reported: {scan(repo)}")
            return 1
    print("self-test: a planted machine path is reported with its file and line")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not (a.repo / ".git").exists():
        print(f"{a.repo} is not a git checkout: nothing to scan")
        return 77
    hits = scan(a.repo)
    for h in hits:
        print(h)
    if hits:
        print(f"{len(hits)} line(s) name a path of one machine: write it relative to the "
              "repository, as $HOME or ~, or through a setting ($KVQ_DATA_DIR, "
              "$KVQ_MODEL_CACHE)", file=sys.stderr)
        return 1
    print(f"no machine paths in {len(tracked_files(a.repo))} tracked files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
