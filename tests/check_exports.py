#!/usr/bin/env python3
"""Fails unless the shared library exports exactly the symbols listed in the
version script, all of them named epipe_*. Given a static archive (a
-Ddefault_library=static build: no link step, so no version script), it
checks what a static archive can promise instead: every global symbol it
defines is named epipe_*, and every symbol the map lists is defined.
Given the public headers' folder as a third argument, it also checks that
the calls declared EPIPE_EXPERIMENTAL are exactly the map's experimental
block, and that every call the headers declare is listed."""
import glob
import os
import re
import subprocess
import sys

lib, mapfile = sys.argv[1], sys.argv[2]
headers = sys.argv[3] if len(sys.argv) > 3 else None
static = lib.endswith(".a")
cmd = ["nm", "--defined-only", "-g", lib] if static else ["nm", "-D", "--defined-only", lib]
out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
exported = set()
for line in out.splitlines():
    parts = line.split()
    if len(parts) >= 3 and parts[1] in "TDBRVWiu":
        name = parts[2].split("@")[0]
        if name.startswith("EPIPE_"):  # the version node itself
            continue
        exported.add(name)
text = re.sub(r"/\*.*?\*/", "", open(mapfile).read(), flags=re.S)
listed = set(re.findall(r"^\s*(epipe_\w+);", text, flags=re.M))
bad = sorted(s for s in exported if not s.startswith("epipe_"))
extra = set() if static else sorted(exported - listed)
missing = sorted(listed - exported)
ok = True
if bad:
    print("exported symbols without the epipe_ prefix:", ", ".join(bad)); ok = False
if extra:
    print("exported but not in libepipe.map:", ", ".join(extra)); ok = False
if missing:
    print("listed in libepipe.map but not exported:", ", ".join(missing)); ok = False
if headers:
    raw = open(mapfile).read()
    marker = "EPIPE_EXPERIMENTAL in the headers"
    if marker not in raw:
        print("libepipe.map has no experimental block (a comment naming", marker + ")")
        ok = False
    else:
        block = re.sub(r"/\*.*?\*/", "", raw.split(marker, 1)[1].split("*/", 1)[1], flags=re.S)
        map_exp = set(re.findall(r"^\s*(epipe_\w+);", block, flags=re.M))
        declared, hdr_exp = set(), set()
        for h in sorted(glob.glob(os.path.join(headers, "*.h"))):
            for mark, name in re.findall(r"^(EPIPE_API|EPIPE_EXPERIMENTAL)\b[^(;]*?\b(epipe_\w+)\(",
                                         open(h).read(), flags=re.M):
                declared.add(name)
                if mark == "EPIPE_EXPERIMENTAL":
                    hdr_exp.add(name)
        if not declared:
            print("no EPIPE_API declarations found under", headers); ok = False
        for what, names in (("declared EPIPE_EXPERIMENTAL but not in the map's experimental block",
                             hdr_exp - map_exp),
                            ("in the map's experimental block but not declared EPIPE_EXPERIMENTAL",
                             map_exp - hdr_exp),
                            ("declared in the headers but not in libepipe.map", declared - listed)):
            if names:
                print(what + ":", ", ".join(sorted(names))); ok = False
        print(f"{len(declared)} declarations, {len(hdr_exp)} experimental, checked against the map")
kind = "global symbols of the static archive" if static else "exported symbols"
print(f"{len(exported)} {kind} checked")
sys.exit(0 if ok else 1)
