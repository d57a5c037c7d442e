#!/usr/bin/env python3
"""litgpt.h's LG_CUDA_STACK_FRAME_MAX against the compiler: the largest "N bytes stack frame"
in ptxas's resource usage (nvcc --resource-usage, kept by make's build/cuda_compiles step) must
equal it, so that the local memory the runtime reserves before the arena (lg_cuda_reserve_local)
and the plan's estimate (lg_cuda_runtime_estimate_parts) hold every kernel's frame.

    python3 tests/check_stack_frames.py build/cuda_resource_usage.txt [litgpt.h]"""
import re
import sys

FUNCTION = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame")
CONSTANT = re.compile(r"#define LG_CUDA_STACK_FRAME_MAX (\d+)")


def largest_frame(lines):
    name, best, where = None, 0, None
    for line in lines:
        f = FUNCTION.search(line)
        if f:
            name = f.group(1)
        m = FRAME.search(line)
        if m and int(m.group(1)) > best:
            best, where = int(m.group(1)), name
    return best, where


def main():
    usage = open(sys.argv[1]).read().splitlines()
    header = open(sys.argv[2] if len(sys.argv) > 2 else "litgpt.h").read()
    constant = CONSTANT.search(header)
    frame, kernel = largest_frame(usage)
    if not constant or not any(FRAME.search(line) for line in usage):
        print("check_stack_frames: no LG_CUDA_STACK_FRAME_MAX or no resource usage to check")
        return 1
    if int(constant.group(1)) != frame:
        print("check_stack_frames: the largest stack frame is %d B (%s), LG_CUDA_STACK_FRAME_MAX "
              "says %s: update it (and README's context table, make context-table)"
              % (frame, kernel, constant.group(1)))
        return 1
    print("stack frames: the largest is %d B (%s) = LG_CUDA_STACK_FRAME_MAX" % (frame, kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
