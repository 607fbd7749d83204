#!/usr/bin/env python3
"""Checks the tree's Notes: each defined once, every other mention a reference.

A Note is a long explanation that several places share (PyTorch's
convention). It is defined once, by a comment line holding only its heading,
underlined by a comment line of as many '~' as the heading has characters:

    // Note [Some name]
    // ~~~~~~~~~~~~~~~~
    // The explanation ...

Everywhere else it is named by a reference, 'See Note [Some name]' or
'see Note [Some name]', optionally followed by ' in path/file.h' (or a
Markdown `path/file.h`), and then that file must be the one defining it.

Checked: the tracked files (git ls-files; without git, a walk that skips
.git and build*/). In C, C++, CUDA, proto and JavaScript files only comments
count (a string literal is code); elsewhere the whole text does. Markdown
files only refer to Notes, they define none. docs/cli.md is left out: it is
the commands' --help, generated (scripts/cli_reference.py).

Prints one line per problem (file:line: what is wrong) and a one-line
summary; exits 1 when there is a problem, else 0.
"""

import argparse
import os
import re
import subprocess
import sys

C_LIKE = ('.h', '.hh', '.hpp', '.c', '.cc', '.cpp', '.cu', '.cuh', '.proto',
          '.js')
OTHER = ('.py', '.sh', '.cmake', '.md', '.txt', '.yml', '.yaml', '.toml',
         '.cfg', '.in')
NAMES = ('CMakeLists.txt', 'Dockerfile', 'Makefile')
SKIP = ('docs/cli.md',)

# Between the words of a heading or a reference: blanks, or a line break
# followed by the next line's comment leader.
WS = r'(?=[ \t\n])[ \t]*(?:\n[ \t]*(?:(?://+!?|#+|\*(?!/))[ \t]*)?)*'
MENTION = re.compile(r'\bNote' + WS + r'\[([^\]\[]*)\]')
PLURAL = re.compile(r'\bNotes' + WS + r'\[')
SEE = re.compile(r'(?:^|[^\w])[Ss]ee' + WS + r'\Z')
WHERE = re.compile(WS + r'in' + WS + r'`?([\w./-]*[\w])`?')
LEADER = r'[ \t]*(?://+!?|#+|/\*+|\*)?[ \t]*'
HEADING = re.compile(r'^' + LEADER + r'Note \[([^\]\[]+)\][ \t]*(?:\*/)?[ \t]*$')
UNDERLINE = re.compile(r'^' + LEADER + r'(~+)[ \t]*(?:\*/)?[ \t]*$')


def tracked_files(root):
    try:
        out = subprocess.run(['git', 'ls-files', '-z'], cwd=root, check=True,
                             capture_output=True).stdout
        return [p for p in out.decode().split('\0') if p]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs
                             if x != '.git' and not x.startswith('build'))
            for n in sorted(names):
                files.append(os.path.relpath(os.path.join(d, n), root))
        return files


def wanted(path):
    base = os.path.basename(path)
    return path not in SKIP and (base in NAMES or base.endswith(C_LIKE + OTHER))


def comments_only(text):
    """The text with everything but its comments blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)

    def blank(s):
        out.append(re.sub(r'[^\n]', ' ', s))

    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(text[i:j])
            i = j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(text[i:j])
            i = j
        elif c == 'R' and text.startswith('R"', i) and (
                i == 0 or not (text[i - 1].isalnum() or text[i - 1] == '_')):
            m = re.match(r'R"([^()\\ \n]{0,16})\(', text[i:])
            if not m:
                blank(c)
                i += 1
                continue
            end = text.find(')' + m.group(1) + '"', i + m.end())
            j = n if end < 0 else end + len(m.group(1)) + 2
            blank(text[i:j])
            i = j
        elif c in '"\'':
            j = i + 1
            while j < n and text[j] != c and text[j] != '\n':
                j += 2 if text[j] == '\\' else 1
            j = min(j + 1, n)
            blank(text[i:j])
            i = j
        else:
            blank(c)
            i += 1
    return ''.join(out)


def squash(name):
    return re.sub(WS, ' ', name).strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--root', default=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument('--list', action='store_true',
                    help='print every definition and reference found')
    args = ap.parse_args()
    root = args.root
    me = os.path.relpath(os.path.abspath(__file__), root)

    problems = []
    defs = {}  # name -> [(path, line)]
    refs = []  # (path, line, name, where)
    for path in tracked_files(root):
        if path in (me, 'scripts/check_notes.py') or not wanted(path):
            continue
        try:
            with open(os.path.join(root, path), encoding='utf-8') as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        if 'Note' not in text:
            continue
        raw = text
        if path.endswith(C_LIKE):
            text = comments_only(text)
        lines = text.split('\n')
        original = raw.split('\n')
        markdown = path.endswith('.md')

        def line_of(pos):
            return text.count('\n', 0, pos) + 1

        for m in PLURAL.finditer(text):
            problems.append('%s:%d: "Notes [": write each as "see Note [Name]"'
                            % (path, line_of(m.start())))
        for m in MENTION.finditer(text):
            name = squash(m.group(1))
            ln = line_of(m.start())
            where = WHERE.match(text, m.end())
            where = where.group(1) if where and re.search(
                r'[./]', where.group(1)) else None
            heading = (HEADING.match(lines[ln - 1]) and
                       HEADING.match(original[ln - 1]))
            if heading and '\n' not in m.group(0):
                if markdown:
                    problems.append('%s:%d: Note [%s] defined in Markdown; '
                                    'docs only refer to Notes' % (path, ln, name))
                    continue
                under = UNDERLINE.match(lines[ln]) if ln < len(lines) else None
                want = len('Note [%s]' % name)
                if not under:
                    problems.append('%s:%d: heading Note [%s] is not underlined '
                                    '(the next comment line: %d "~")'
                                    % (path, ln, name, want))
                elif len(under.group(1)) != want:
                    problems.append('%s:%d: underline of Note [%s] has %d "~", '
                                    'not %d' % (path, ln + 1, name,
                                                len(under.group(1)), want))
                defs.setdefault(name, []).append((path, ln))
            elif SEE.search(text, max(0, m.start() - 80), m.start()):
                refs.append((path, ln, name, where))
            else:
                problems.append('%s:%d: Note [%s] is neither a definition (a '
                                'heading line, then its "~" underline) nor a '
                                'reference ("see Note [%s]")'
                                % (path, ln, name, name))

    for name, places in sorted(defs.items()):
        for path, ln in places[1:]:
            problems.append('%s:%d: Note [%s] defined again (first at %s:%d)'
                            % (path, ln, name, places[0][0], places[0][1]))
    for path, ln, name, where in refs:
        if name not in defs:
            problems.append('%s:%d: Note [%s] is not defined anywhere'
                            % (path, ln, name))
        elif where:
            at = defs[name][0][0]
            if at != where and not at.endswith('/' + where):
                problems.append('%s:%d: Note [%s] is defined in %s, not in %s'
                                % (path, ln, name, at, where))

    if args.list:
        for name, places in sorted(defs.items()):
            print('def %s:%d: %s' % (places[0][0], places[0][1], name))
        for path, ln, name, where in refs:
            print('ref %s:%d: %s%s' % (path, ln, name,
                                       ' in ' + where if where else ''))
    for p in problems:
        print(p)
    print('check_notes: %d notes, %d references, %d problems'
          % (len(defs), len(refs), len(problems)))
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
