#!/usr/bin/env python3
"""Writes (or checks) docs/cli.md: every command's --help and the environment table, as the binaries print them.

    scripts/cli_reference.py --bin-dir build/bin > docs/cli.md   # regenerate
    scripts/cli_reference.py --bin-dir build/bin --check docs/cli.md

--check exits 1 with a one-line reason when the file differs from what the
binaries print now (ctest runs it: the reference cannot go stale).
"""
import argparse
import os
import re
import subprocess
import sys

# (command line, title); concordctl's commands have their own help. The
# last is the CONCORD_* table (common/environment.h) that the worker reads.
COMMANDS = [
    (["concord-coordinator", "--help"], "The coordinator service"),
    (["concord-run", "--help"], "The launcher"),
    (["concord-train", "--help"], "The trainer"),
    (["concordctl", "--help"], "The operator CLI"),
    (["concordctl", "jobs", "--help"], None),
    (["concordctl", "status", "--help"], None),
    (["concordctl", "events", "--help"], None),
    (["concordctl", "checkpoints", "--help"], None),
    (["concordctl", "watch", "--help"], None),
    (["concordctl", "drain", "--help"], None),
    (["concordctl", "stop", "--help"], None),
    (["concord-run", "--env"], "The environment variables"),
]

HEADER = """# CLI reference

Generated from the binaries' `--help` (and `concord-run --env`, the table of
the CONCORD_* variables a worker reads) by `scripts/cli_reference.py
--bin-dir build/bin > docs/cli.md`; ctest's `cli_reference` test fails when
this file and the binaries disagree. Flags that do not fit exit with status 2
and a one-line error naming the flag, before anything starts.
"""


def help_text(bin_dir, argv):
    exe = os.path.join(bin_dir, argv[0])
    out = subprocess.run([exe] + argv[1:], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        sys.exit(f"cli_reference: '{' '.join(argv)}' exited "
                 f"{out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    text = out.stdout + out.stderr
    # CLI11 prints argv[0] in its usage line: make it the bare name.
    text = text.replace(exe, argv[0])
    return "\n".join(cli11_23_defaults(line.rstrip())
                     for line in text.strip().splitlines())


def cli11_23_defaults(line):
    """An option's default as CLI11 2.3 (Debian 12) prints it, `TYPE=DEFAULT`.

    CLI11 2.4 and later (Debian 13) print `TYPE [DEFAULT]`; the reference is
    one text whichever CLI11 the binaries were built with. A range such as
    `INT in [2 - 600]` is not a default.
    """
    if not line.lstrip().startswith("-"):
        return line
    return re.sub(r"(?<! in) \[([^\[\]]*)\]$", r"=\1", line)


def render(bin_dir):
    parts = [HEADER.strip()]
    for argv, title in COMMANDS:
        name = " ".join(a for a in argv if a != "--help")
        heading = "##" if title else "###"
        parts.append(f"{heading} `{name}`" + (f" — {title}" if title else ""))
        parts.append("```text\n" + help_text(bin_dir, argv) + "\n```")
    return "\n\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--check", metavar="FILE")
    args = ap.parse_args()
    text = render(args.bin_dir)
    if not args.check:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.check, encoding="utf-8") as f:
            current = f.read()
    except OSError as e:
        print(f"cli_reference: cannot read {args.check}: {e.strerror}")
        return 1
    if current != text:
        cur, new = current.splitlines(), text.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(cur, new)) if a != b),
                     min(len(cur), len(new)))
        print(f"cli_reference: {args.check} is stale from line {first + 1} "
              f"(run scripts/cli_reference.py --bin-dir BIN > {args.check})")
        return 1
    print(f"cli_reference: {args.check} matches {len(COMMANDS)} outputs "
          "(--help and the environment table)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
