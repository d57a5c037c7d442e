#!/usr/bin/env python3
"""The code a GPU of each architecture loads, measured from the binaries themselves (no GPU,
no cuobjdump: readelf and zstd read the .nv_fatbin section): litgpt.h's LG_CUDA_ARCH_CODE
figures (lg_cuda_arch_codes) come from this.

    python3 tools/cuda_code_sizes.py [--check litgpt.h] [OUR_BINARY_OR_OBJECT] [LIBCUBLASLT]

--check: exit 1 unless litgpt.h's lg_cuda_arch_codes hold these figures (our image's code
where the card runs SASS of ours; cuBLASLt's code and largest kernel for every architecture).

For each architecture (sm_80, 86, 89, 90, 100, 120), the image the driver picks from each
fatbin container (the SASS of the same major version with the highest minor version not above
the card's, else the newest PTX not above it, compiled at load) and, summed over the
containers, the bytes of its kernels' code (the .text.KERNEL sections of the cubins, after
zstd decompression where compressed): what eager loading would put on the card, and the
largest kernel (what one kernel loaded lazily can cost). PTX has no code until compiled: its
text bytes are given, and litgpt.h counts the SASS of the nearest architecture instead."""
import os
import re
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50       # a fatbin container's first word
CONTAINER = "<IHHQ"             # magic, version, header size, bytes of entries that follow
ENTRY = "<HHIIIIIIIIIQQQ"       # kind, version, header size, padded size, -, stored size, -,
                                # -, architecture, -, -, flags, -, decompressed size
KIND_PTX, KIND_ELF = 1, 2
ARCHS = (80, 86, 89, 90, 100, 120)


def section(path, name):
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = line.replace("[ ", "[").split()
        if len(f) > 5 and f[1] == name:
            with open(path, "rb") as fh:
                fh.seek(int(f[4], 16))
                return fh.read(int(f[5], 16))
    return b""


def containers(data):
    """Each container's entries: (kind, arch, offset of the payload, stored bytes, compressed)."""
    pos = 0
    while pos + struct.calcsize(CONTAINER) <= len(data):
        magic, _, header, size = struct.unpack_from(CONTAINER, data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        at, end, entries = pos + header, pos + header + size, []
        while at < end:
            kind, _, eh, padded, _, stored, _, _, arch, _, _, _, _, full = struct.unpack_from(ENTRY, data, at)
            entries.append((kind, arch, at + eh, stored or padded, full != 0))
            at += eh + padded
        yield entries
        pos = end


def picked(entries, arch):
    major, minor = divmod(arch, 10)
    sass = [e for e in entries if e[0] == KIND_ELF and e[1] // 10 == major and e[1] % 10 <= minor]
    if sass:
        return max(sass, key=lambda e: e[1])
    ptx = [e for e in entries if e[0] == KIND_PTX and e[1] <= arch]
    return max(ptx, key=lambda e: e[1]) if ptx else None


def kernel_code(blob, compressed, scratch):
    """The .text section sizes of one cubin."""
    if compressed:
        blob = subprocess.run(["zstd", "-dc"], input=blob, capture_output=True).stdout
    with open(scratch, "wb") as fh:
        fh.write(blob)
    out = subprocess.run(["readelf", "-S", "-W", scratch], capture_output=True, text=True).stdout
    sizes = []
    for line in out.splitlines():
        f = line.replace("[ ", "[").split()
        if len(f) > 5 and f[1].startswith(".text."):
            sizes.append(int(f[5], 16))
    return sizes


def measure(path, arch, scratch):
    data = section(path, ".nv_fatbin")
    sizes, images = [], set()
    for entries in containers(data):
        e = picked(entries, arch)
        if not e:
            continue
        images.add(("sm_%d" if e[0] == KIND_ELF else "compute_%d PTX") % e[1])
        if e[0] == KIND_ELF:
            sizes.extend(kernel_code(data[e[2]:e[2] + e[3]], e[4], scratch))
    return sum(sizes), max(sizes, default=0), len(sizes), sorted(images)


def recorded(header):
    """litgpt.h's lg_cuda_arch_codes: {arch: (own code, cuBLASLt code, largest kernel)}."""
    table = header[header.index("lg_cuda_arch_codes[] = {"):]
    table = table[:table.index("};")]
    rows = re.findall(r'\{(\d+), (\d+), (\d+), "[^"]*", (\d+), (\d+)\}', table)
    return {int(a) * 10 + int(b): (int(o), int(t), int(k)) for a, b, o, t, k in rows}


def main():
    args = sys.argv[1:]
    check = None
    if args[:1] == ["--check"]:
        with open(args[1]) as fh:
            check = recorded(fh.read())
        args = args[2:]
    ours = args[0] if args else "build/train_cuda"
    lt = args[1] if len(args) > 1 else "/usr/local/cuda/lib64/libcublasLt.so"
    scratch = "build/cuda_code_sizes.cubin"
    os.makedirs("build", exist_ok=True)
    print("arch    ours: code (image)                      cuBLASLt: all kernels' code, "
          "largest kernel (kernels)")
    differ = []
    for arch in ARCHS:
        own, _, _, own_images = measure(ours, arch, scratch)
        total, largest, n, _ = measure(os.path.realpath(lt), arch, scratch)
        print("sm_%-4d %10d B (%-28s) %11d B, %7d B (%d)" % (arch, own, ", ".join(own_images) or
              "none", total, largest, n))
        want = check.get(arch) if check is not None else None
        if check is not None and (not want or (own and want[0] != own) or want[1:] != (total, largest)):
            differ.append("sm_%d" % arch)
    os.remove(scratch)
    if differ:
        print("litgpt.h's lg_cuda_arch_codes differ for %s: update them (and make context-table)"
              % ", ".join(differ))
        return 1
    if check is not None:
        print("litgpt.h's lg_cuda_arch_codes hold these figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
