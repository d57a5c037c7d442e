#!/usr/bin/env python3
"""How much of litgpt.h a reader follows to see one training step (issue 24's "the step on
one screen", measured): from lg_trainer_step, every function it calls, and theirs, down to
the kernels. A call into section 7 (the kernels) or 6 (memory primitives), 1-2 (utilities,
numbers) ends the walk there: the ops are where the step's reading stops. Every branch counts
(sharding, offload, Sophia, MPI), so this is what a reader could meet, not one run's path.
Prints the functions by section with their lines, and the totals.

    python3 tools/step_reach.py [litgpt.h] [--from lg_trainer_step]"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
from check_order import SECTION, blank_comments_and_strings, definitions  # noqa: E402

STOP_SECTIONS = {'1', '2', '6', '7'}  # utilities, numbers, memory, kernels: the ops


def main(argv):
    path = next((a for a in argv if a.endswith('.h')), 'litgpt.h')
    start = argv[argv.index('--from') + 1] if '--from' in argv else 'lg_trainer_step'
    src = open(path, encoding='utf-8').read()
    lines, code = src.split('\n'), blank_comments_and_strings(src).split('\n')
    impl = next(i for i, l in enumerate(lines) if l.startswith('#ifdef LITGPT_IMPLEMENTATION'))
    banners = [(i, m.group(1)) for i, l in enumerate(lines) if i > impl and (m := SECTION.match(l))]
    funcs = {name: (a, b) for name, a, b in definitions(code) if a > impl}

    def section(line):
        return max((b for b in banners if b[0] <= line), default=(0, '0'))[1]

    seen, todo, ops = set(), [start], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in funcs:
            continue
        a, b = funcs[name]
        if section(a) in STOP_SECTIONS:
            ops.add(name)
            continue
        seen.add(name)
        body = ' '.join(code[a:b + 1])
        todo.extend(c for c in set(re.findall(r'\b(\w+)\s*\(', body)) if c != name)
    by_section = {}
    for name in seen:
        a, b = funcs[name]
        by_section.setdefault(section(a), []).append((a, name, b - a + 1))
    total = 0
    for sec in sorted(by_section, key=int):
        entries = sorted(by_section[sec])
        size = sum(n for _, _, n in entries)
        total += size
        print(f'section {sec}: {len(entries)} functions, {size} lines')
        for a, name, n in entries:
            print(f'  {a + 1:6d} {name} ({n} lines)')
    print(f'{start}: {len(seen)} functions, {total} lines above the ops, over '
          f'{len(by_section)} sections; {len(ops)} ops and primitives reached')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
