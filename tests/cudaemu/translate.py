#!/usr/bin/env python3
"""Rewrites a .cu file into C++ that the CUDA emulator (tests/cudaemu/)
compiles with the host's C++ compiler: the three CUDA constructs that are
syntax rather than functions.

  kernel<<<grid, block[, shared[, stream]]>>>(args)
      -> cudaemu_launch(cudaemu_cfg(grid, block, ...), kernel, args)
  (const void *)kernel            (a __global__ function of this file)
      -> cudaemu_kernel_ptr(kernel)   (a launchable pointer, registered)
  extern __shared__ T name[];
      -> T *name = (T *)cudaemu_dynamic_shared();

Lines keep their numbers (a #line directive names the original file), so
compiler messages and test failures point at the real source.

usage: translate.py IN.cu OUT.cc
"""
import re
import sys

LAUNCH = re.compile(r"(\b[A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\((\s*\))?", re.S)
DYN_SHARED = re.compile(r"extern\s+__shared__\s+([\w\s]+?)\s+(\w+)\s*\[\s*\]\s*;")
GLOBAL_NAME = re.compile(
    r"__global__\s+(?:static\s+)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(")


def launch(m):
    kernel, cfg, empty = m.group(1), m.group(2), m.group(3)
    head = "cudaemu_launch(cudaemu_cfg(%s), %s" % (cfg, kernel)
    return head + ")" if empty else head + ", "


def translate(text, path):
    kernels = set(GLOBAL_NAME.findall(text))
    if kernels:
        names = "|".join(sorted(kernels, key=len, reverse=True))
        ptr = re.compile(r"\(const void \*\)\s*((?:%s)(?:<[^<>;()]*>)?)(?![\w<])" % names)
        text = ptr.sub(r"cudaemu_kernel_ptr(\1)", text)
    text = LAUNCH.sub(launch, text)
    text = DYN_SHARED.sub(r"\1 *\2 = (\1 *)cudaemu_dynamic_shared();", text)
    if "<<<" in text or ">>>" in text:
        line = text[: text.index("<<<" if "<<<" in text else ">>>")].count("\n") + 1
        sys.exit("%s:%d: a kernel launch translate.py does not understand" % (path, line))
    return '#line 1 "%s"\n' % path + text


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    src, out = sys.argv[1], sys.argv[2]
    with open(src, encoding="utf-8") as f:
        text = f.read()
    with open(out, "w", encoding="utf-8") as f:
        f.write(translate(text, src))


if __name__ == "__main__":
    main()
