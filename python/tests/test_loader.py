"""How `import epipe` finds libepipe outside a source tree: EPIPE_LIBRARY,
pkg-config's libdir, the install prefix, and an error naming all three when
none has it. Each case imports a copy of the package in a fresh interpreter."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import epipe

LIB = os.path.realpath(epipe.library_path)


@pytest.fixture
def pkg(tmp_path):
    """A copy of the epipe package in a directory outside any source tree."""
    shutil.copytree(os.path.dirname(epipe.__file__), tmp_path / "site" / "epipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _import(pkg, env_extra, code="import epipe; print(epipe.library_path, epipe.__version__)"):
    env = {k: v for k, v in os.environ.items()
           if k not in ("EPIPE_LIBRARY", "PKG_CONFIG_PATH", "LD_LIBRARY_PATH", "PYTHONPATH")}
    # no system or user epipe.pc is seen unless a test adds its own
    env.update({"PYTHONPATH": str(pkg / "site"), "PKG_CONFIG_LIBDIR": str(pkg / "no-pc"),
                "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], cwd=str(pkg), env=env,
                          capture_output=True, text=True, timeout=60)


def _loader_sees_a_system_copy():
    r = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libepipe.so.0')"],
                       capture_output=True, env={"PATH": os.environ.get("PATH", "")})
    return r.returncode == 0


def test_epipe_library_is_used_as_given(pkg):
    r = _import(pkg, {"EPIPE_LIBRARY": LIB})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [LIB, epipe.__version__]


def test_a_bad_epipe_library_names_the_path(pkg):
    r = _import(pkg, {"EPIPE_LIBRARY": str(pkg / "nope" / "libepipe.so")})
    assert r.returncode != 0
    assert "EPIPE_LIBRARY=" + str(pkg / "nope" / "libepipe.so") in r.stderr


def test_pkg_config_libdir_is_used(pkg):
    if shutil.which("pkg-config") is None:
        pytest.skip("no pkg-config")
    libdir = pkg / "prefix" / "lib"
    libdir.mkdir(parents=True)
    os.symlink(LIB, libdir / "libepipe.so.0")
    pc = pkg / "pc"
    pc.mkdir()
    (pc / "epipe.pc").write_text(textwrap.dedent(f"""\
        prefix={pkg / 'prefix'}
        libdir=${{prefix}}/lib
        includedir=${{prefix}}/include
        Name: epipe
        Description: test
        Version: {epipe.__version__}
        Libs: -L${{libdir}} -lepipe
        """))
    r = _import(pkg, {"PKG_CONFIG_LIBDIR": str(pc)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == str(libdir / "libepipe.so.0")


def test_the_install_prefix_is_searched(pkg):
    # a virtual environment's prefix (sys.prefix) holds the library
    venv = pkg / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                        str(venv)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"no venv module: {r.stderr.strip()[-200:]}")
    (venv / "lib").mkdir(exist_ok=True)
    os.symlink(LIB, venv / "lib" / "libepipe.so.0")
    env = {k: v for k, v in os.environ.items()
           if k not in ("EPIPE_LIBRARY", "PKG_CONFIG_PATH", "LD_LIBRARY_PATH")}
    env.update({"PYTHONPATH": str(pkg / "site"), "PKG_CONFIG_LIBDIR": str(pkg / "no-pc")})
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import epipe; print(epipe.library_path)"],
                       cwd=str(pkg), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    found = r.stdout.strip()  # lib64 is a link to lib in a venv
    assert found.startswith(str(venv) + "/") and os.path.realpath(found) == LIB, found


def test_failure_names_every_place_tried(pkg):
    if _loader_sees_a_system_copy():
        pytest.skip("a libepipe.so.0 is on the system loader's path")
    r = _import(pkg, {})
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert "ImportError: cannot find libepipe" in err
    for place in ("EPIPE_LIBRARY: not set", "pkg-config: ", "install prefix: no libepipe.so.0 in",
                  sys.prefix):
        assert place in err, err


def test_a_library_of_another_minor_is_refused_at_import(pkg):
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler")
    src = pkg / "fake.c"
    src.write_text('unsigned epipe_version(void) { return 200; }\n'
                   'const char *epipe_version_string(void) { return "0.2.0"; }\n')
    fake = pkg / "libepipe.so.0"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(fake)], check=True)
    r = _import(pkg, {"EPIPE_LIBRARY": str(fake)})
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert "ImportError: libepipe 0.2.0 at %s does not match" % fake in err, err
    assert "written for libepipe %s" % epipe.__version__ in err, err
