#!/usr/bin/env python3
"""Fails unless the shared library exports exactly the symbols listed in the
version script, all of them named epipe_*. Given a static archive (a
-Ddefault_library=static build: no link step, so no version script), it
checks what a static archive can promise instead: every global symbol it
defines is named epipe_*, and every symbol the map lists is defined."""
import re
import subprocess
import sys

lib, mapfile = sys.argv[1], sys.argv[2]
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
kind = "global symbols of the static archive" if static else "exported symbols"
print(f"{len(exported)} {kind} checked")
sys.exit(0 if ok else 1)
