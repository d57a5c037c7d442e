#!/usr/bin/env python3
"""The reader's map, checked: in litgpt.h's implementation every call goes to a function defined
above it in an earlier section or the same one (no call reaches up into a later section), and no
function is longer than the style allows (80 lines in litgpt.h and train.c, 110 in the CUDA
kernels). Prints each violation as file:line and exits 1 if there is one. train.c's long
functions (its flag switch and main, issue 24's guided tour) are reported but do not fail yet.

    python3 tests/check_order.py [--calls] [litgpt.h train.c litgpt_cuda.cuh]

--calls also lists the calls to a later function of the same section (which need a forward
declaration); they are allowed (recursion, a loop's driver beside its steps) and counted."""
import re
import sys

SECTION = re.compile(r'^/\* (\d+)\. (.*?) -{3,}')
NOT_NAMES = {'if', 'for', 'while', 'switch', 'return', 'sizeof', 'defined', '_Alignof',
             '__attribute__', '_Static_assert', 'do', 'else', 'case', '__launch_bounds__'}
LIMITS = {'litgpt.h': 80, 'train.c': 80, 'litgpt_cuda.cuh': 110}
NOT_YET = {'train.c'}  # reported, not failing (see the docstring)


def blank_comments_and_strings(src):
    """src with comments, strings and character literals blanked; line breaks kept."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith('/*', i):
            j = src.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', src[i:j]))
        elif src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i))
        elif src[i] in '"\'':
            j = i + 1
            while j < n and src[j] != src[i]:
                j += 2 if src[j] == '\\' else 1
            j += 1
            out.append(src[i] + ' ' * (j - i - 2) + src[i])
        else:
            j = i + 1
            out.append(src[i])
        i = j
    return ''.join(out)


def definitions(code):
    """[name, first line, last line] (0-based) of every top-level function definition."""
    found, depth, directive = [], 0, False
    for i, line in enumerate(code):
        if directive or line.lstrip().startswith('#'):  # a directive, with its continuations
            directive = line.rstrip().endswith('\\')
            continue
        for k, ch in enumerate(line):
            if ch == '{':
                if depth == 0:
                    head = '\n'.join(code[max(0, i - 12):i] + [line[:k]])
                    head = re.split(r'[;{}]', re.sub(r'(?m)^\s*#.*$', ' ', head))[-1]
                    names = [m for m in re.findall(r'(\w+)\s*\(', head)
                             if m not in NOT_NAMES and not m.startswith('LG_TARGET')]
                    if names and head.rstrip().endswith(')') and '=' not in head.split('(')[0]:
                        found.append([names[0], i, None])
                depth += 1
            elif ch == '}':
                depth -= 1
                if depth == 0 and found and found[-1][2] is None:
                    found[-1][2] = i
    return [f for f in found if f[2] is not None]


def calls_up(path, lines, code, funcs, show_same):
    """Calls from a function to one defined later; those into a later section are errors."""
    impl = next(i for i, l in enumerate(lines) if l.startswith('#ifdef LITGPT_IMPLEMENTATION'))
    banners = [(i, m.group(1)) for i, l in enumerate(lines) if i > impl and (m := SECTION.match(l))]

    def section(line):
        return max((b for b in banners if b[0] <= line), default=(0, '0'))[1]

    first = {}
    for name, a, _ in funcs:
        first.setdefault(name, a)
    errors, same = 0, 0
    for name, a, b in funcs:
        if a < impl:
            continue
        for callee in sorted(set(re.findall(r'\b(\w+)\s*\(', ' '.join(code[a:b + 1])))):
            if callee == name or first.get(callee, -1) <= a:
                continue
            where = f'{path}:{a + 1}: {name} (section {section(a)}) calls {callee} ' \
                    f'(section {section(first[callee])}, line {first[callee] + 1})'
            if section(a) != section(first[callee]):
                errors += 1
                print(where + ': a call up into a later section')
            else:
                same += 1
                if show_same:
                    print(where)
    return errors, same


def main(argv):
    show_same = '--calls' in argv
    paths = [a for a in argv if not a.startswith('--')] or list(LIMITS)
    errors = 0
    for path in paths:
        src = open(path, encoding='utf-8').read()
        lines, code = src.split('\n'), blank_comments_and_strings(src).split('\n')
        funcs = definitions(code)
        limit = LIMITS.get(path.rsplit('/', 1)[-1], 80)
        for name, a, b in funcs:
            if b - a + 1 > limit:
                enforced = path.rsplit('/', 1)[-1] not in NOT_YET
                errors += enforced
                print(f'{path}:{a + 1}: {name} is {b - a + 1} lines (the limit is {limit})'
                      + ('' if enforced else '; not enforced yet'))
        if path.endswith('litgpt.h'):
            up, same = calls_up(path, lines, code, funcs, show_same)
            errors += up
            print(f'{path}: {len(funcs)} functions, {up} calls up into a later section, '
                  f'{same} to a later function of the same section')
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
