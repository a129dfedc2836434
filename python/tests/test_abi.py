"""The binding against the headers of the libepipe it loaded: every hand-copied
constant, enum, struct layout and prototype is compiled or parsed from
include/epipe/*.h and compared, so the binding cannot drift silently."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

import epipe
from epipe import _abi, _lib


def _include_dir():
    """EPIPE_INCLUDE, else the include/ of the source tree the loaded library
    was built in, else that of the checkout this package runs from, else
    pkg-config's includedir for epipe."""
    env = os.environ.get("EPIPE_INCLUDE")
    if env:
        return env
    d = os.path.dirname(os.path.realpath(_lib.library_path))
    pkg_tree = os.path.join(os.path.dirname(os.path.abspath(epipe.__file__)), "..", "..")
    for up in (os.path.join(d, "..", ".."), os.path.join(d, ".."), pkg_tree):
        if os.path.isfile(os.path.join(up, "meson.build")) and \
                os.path.isfile(os.path.join(up, "include", "epipe", "common.h")):
            return os.path.normpath(os.path.join(up, "include"))
    try:
        r = subprocess.run(["pkg-config", "--variable=includedir", "epipe"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode == 0 and os.path.isfile(os.path.join(r.stdout.strip(), "epipe",
                                                             "common.h")):
            return r.stdout.strip()
    except OSError:
        pass
    pytest.fail(f"no headers for the libepipe at {_lib.library_path}: set EPIPE_INCLUDE")


INC = _include_dir()
CC = shutil.which(os.environ.get("CC", "cc"))


def _headers():
    d = os.path.join(INC, "epipe")
    return {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d)) if f.endswith(".h")}


def _strip_comments(src):
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", src, flags=re.S)


def _run_c(tmp_path, body):
    """Compiles and runs a main() that includes <epipe/epipe.h>; its stdout."""
    if CC is None:
        pytest.skip("no C compiler (set CC)")
    src = tmp_path / "probe.c"
    src.write_text("#include <epipe/epipe.h>\n#include <stddef.h>\n#include <stdio.h>\n"
                   "int main(void)\n{\n" + body + "    return 0;\n}\n")
    exe = tmp_path / "probe"
    r = subprocess.run([CC, "-std=c99", "-I", INC, str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{CC} failed on the probe:\n{r.stderr}"
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_constants_match_the_headers(tmp_path):
    body = "".join(f'    printf("{k} %lld\\n", (long long)({k}));\n' for k in _abi.C)
    got = dict(line.split() for line in _run_c(tmp_path, body).splitlines())
    bad = {k: (v, int(got[k])) for k, v in _abi.C.items() if int(got[k]) != v}
    assert not bad, f"binding vs header (name: (binding, header)): {bad}"


def test_mirrored_enums_are_complete():
    enums = {}
    for name, src in _headers().items():
        for body, tag in re.findall(r"typedef\s+enum\s+\w*\s*\{(.*?)\}\s*(\w+)\s*;",
                                    _strip_comments(src), re.S):
            enums[tag] = re.findall(r"\b(EPIPE_[A-Z0-9_]+)\s*(?:=|,|$)", body.strip())
    for tag in _abi.MIRRORED_ENUMS:
        assert tag in enums, f"the headers in {INC} have no enum {tag}"
        missing = [e for e in enums[tag] if e not in _abi.C]
        assert not missing, f"enum {tag} has enumerators the binding lacks: {missing}"
    # every status the headers know has a name in the binding
    assert sorted(_abi.STATUS_NAMES.values()) == sorted(enums["epipe_status"])


STRUCTS = [
    ("epipe_op", _lib.Op),
    ("epipe_stage_stats", _lib.StageStats),
    ("epipe_boundary_stats", _lib.BoundaryStats),
    ("epipe_schedule_layout", _lib.ScheduleLayout),
    ("epipe_plan_layer", _lib.PlanLayer),
    ("epipe_plan_codec", _lib.PlanCodec),
    ("epipe_plan_options", _lib.PlanOptions),
    ("DLDevice", _lib.DLDevice),
    ("DLDataType", _lib.DLDataType),
    ("DLTensor", _lib.DLTensor),
    ("DLManagedTensor", _lib.DLManagedTensor),
]


def test_struct_layouts_match_the_headers(tmp_path):
    body = ""
    for cname, cls in STRUCTS:
        body += f'    printf("{cname} sizeof %zu\\n", sizeof({cname}));\n'
        for field, _ in cls._fields_:
            body += f'    printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));\n'
    got = {}
    for line in _run_c(tmp_path, body).splitlines():
        s, f, v = line.split()
        got[(s, f)] = int(v)
    bad = []
    for cname, cls in STRUCTS:
        if got[(cname, "sizeof")] != ctypes.sizeof(cls):
            bad.append(f"sizeof({cname}) = {got[(cname, 'sizeof')]}, binding "
                       f"{ctypes.sizeof(cls)}")
        for field, _ in cls._fields_:
            if got[(cname, field)] != getattr(cls, field).offset:
                bad.append(f"offsetof({cname}, {field}) = {got[(cname, field)]}, binding "
                           f"{getattr(cls, field).offset}")
    assert not bad, "; ".join(bad)


def _declarations():
    """name -> parameter count of every EPIPE_API function in the headers."""
    out = {}
    for src in _headers().values():
        src = _strip_comments(src)
        pat = r"EPIPE_(?:API|EXPERIMENTAL)\s+[^;{}()]*?\b(epipe_\w+)\s*\(([^;{}]*?)\)\s*;"
        for m in re.finditer(pat, src, re.S):
            params = m.group(2).strip()
            if params in ("", "void"):
                n = 0
            else:
                depth, n = 0, 1
                for ch in params:
                    depth += ch == "("
                    depth -= ch == ")"
                    n += ch == "," and depth == 0
            out[m.group(1)] = n
    return out


def test_prototypes_match_the_headers():
    decl = _declarations()
    assert len(decl) > 40, f"parsed only {len(decl)} declarations from {INC}"
    bad = []
    for name, (_, args) in _lib._PROTOS.items():
        if name not in decl:
            bad.append(f"{name}: not declared in {INC}/epipe")
        elif decl[name] != len(args):
            bad.append(f"{name}: {decl[name]} parameters in the header, {len(args)} in the binding")
    assert not bad, "; ".join(bad)


def test_version_matches_the_library_and_headers(tmp_path):
    assert epipe.__version__ == _abi.VERSION
    assert epipe.version() == epipe.__version__
    out = _run_c(tmp_path, '    printf("%d.%d.%d %u\\n", EPIPE_VERSION_MAJOR, EPIPE_VERSION_MINOR,'
                           ' EPIPE_VERSION_PATCH, EPIPE_VERSION_NUMBER);\n')
    header_version, number = out.split()
    assert int(number) == epipe.version_number()
    assert header_version == epipe.__version__
    root = os.path.dirname(INC)
    meson = os.path.join(root, "meson.build")
    if os.path.isfile(meson):  # a source tree: the project's version too
        m = re.search(r"version\s*:\s*'([0-9.]+)'", open(meson).read())
        assert m and m.group(1) == epipe.__version__


@pytest.mark.parametrize("number,ok", [(100, True), (105, True), (200, False), (10100, False),
                                        (0, False)])
def test_another_major_minor_is_refused(number, ok):
    text = f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    if ok:
        _lib.check_version(number, text, "/x/libepipe.so.0")
    else:
        with pytest.raises(ImportError, match=r"libepipe %s at /x/libepipe.so.0 .*written for "
                                              r"libepipe 0\.1\.0" % re.escape(text)):
            _lib.check_version(number, text, "/x/libepipe.so.0")


def test_errors_carry_the_status_name_and_message():
    with pytest.raises(epipe.Error) as ei:
        epipe.Codec("nosuchcodec")
    e = ei.value
    assert e.name == "EPIPE_EINVAL" and e.status == _abi.C["EPIPE_EINVAL"]
    assert "nosuchcodec" in e.message and "EPIPE_EINVAL" in str(e)
    assert e.function == "epipe_codec_create"
