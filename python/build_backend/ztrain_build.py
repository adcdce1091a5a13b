"""The build backend of `pip install .` (PEP 517, in-tree: pyproject.toml's backend-path).

The extension must be built against the libtorch of the PyTorch it will be imported into, so
this backend builds with the project's own CMake (scripts/build.sh) for the interpreter pip runs
it with, which is the one it installs into, and takes that interpreter's torch. It builds the
target ztrain_python and what it links into the build directory (build/, or $ZTRAIN_BUILD_DIR),
and packs the importable tree that lands there (build/python/ztrain) with the ztrain libraries
the extension loads (ztrain/.libs, found through the extension's $ORIGIN/.libs run path) into a
wheel. A build directory configured already is reused as it is, after checking that its libtorch
is the interpreter's.

    .venv/bin/pip install .                 # or: .venv/bin/python -m pip install .
"""

import base64
import csv
import glob
import hashlib
import io
import os
import re
import subprocess
import sys
import sysconfig
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "ztrain"


def _version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(ztrain VERSION ([0-9.]+)", f.read()).group(1)


def _plain_env():
    """The environment without pip's build isolation, which hides the interpreter's packages."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME"):
        env.pop(key, None)
    return env


def _torch_dir(python):
    probe = subprocess.run([python, "-c", "import os, torch; print(os.path.dirname(torch.__file__))"],
                           env=_plain_env(), capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"pip install .: ztrain is built against the PyTorch of the interpreter it is installed "
                           f"into, and {python} cannot import torch ({why}); "
                           f"use the project environment (scripts/setup.sh, then .venv/bin/pip install .) or "
                           f"install torch there first")
    return os.path.realpath(probe.stdout.strip())


def _cache_value(cache, key):
    with open(cache) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    return None


def _build(python):
    torch_dir = _torch_dir(python)
    build = os.environ.get("ZTRAIN_BUILD_DIR") or os.path.join(ROOT, "build")
    cache = os.path.join(build, "CMakeCache.txt")
    env = _plain_env()
    if os.path.exists(cache):
        built_against = _cache_value(cache, "ZTRAIN_TORCH_PYTHON_LIBRARY") or ""
        if not os.path.realpath(built_against).startswith(torch_dir + os.sep):
            raise RuntimeError(f"pip install .: {build} is configured against the libtorch of '{built_against}', "
                               f"not {python}'s ({torch_dir}); set ZTRAIN_BUILD_DIR to another directory to "
                               f"build for this interpreter")
        cmd = ["cmake", "--build", build, "--target", "ztrain_python"]
    else:
        env.update(ZTRAIN_PYTHON=python, ZTRAIN_BUILD_TARGETS="ztrain_python", ZTRAIN_BUILD_DIR=build)
        cmd = [os.path.join(ROOT, "scripts", "build.sh")]
    print(f"ztrain: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
    package = os.path.join(build, "python", NAME)
    if not glob.glob(os.path.join(package, "_C*.so")):
        raise RuntimeError(f"pip install .: the build made no extension in {package} (configuring said why: the "
                           f"Python headers or libtorch_python were not found)")
    return build, package


def _tag():
    impl = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"{impl}-{impl}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {_version()}\n"
            f"Summary: ZeRO, tensor and pipeline parallelism for PyTorch, native\nRequires-Python: >=3.9\n")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    build, package = _build(sys.executable)
    version = _version()
    dist_info = f"{NAME}-{version}.dist-info"
    files = []  # (name in the wheel, bytes)
    for path in sorted(glob.glob(os.path.join(package, "**", "*"), recursive=True)):
        if os.path.isfile(path) and "__pycache__" not in path:
            with open(path, "rb") as f:
                files.append((f"{NAME}/{os.path.relpath(path, package)}", f.read()))
    for lib in sorted(glob.glob(os.path.join(build, "src", "libztrain_*.so.*"))):
        if lib.count(".so.") == 1 and lib.rsplit(".so.", 1)[1].count(".") == 1:  # the soname: libX.so.0.1
            with open(os.path.realpath(lib), "rb") as f:
                files.append((f"{NAME}/.libs/{os.path.basename(lib)}", f.read()))
    files.append((f"{dist_info}/METADATA", _metadata().encode()))
    files.append((f"{dist_info}/WHEEL",
                  f"Wheel-Version: 1.0\nGenerator: ztrain_build\nRoot-Is-Purelib: false\nTag: {_tag()}\n".encode()))
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([name, f"sha256={digest}", len(data)])
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    files.append((f"{dist_info}/RECORD", record.getvalue().encode()))
    wheel = f"{NAME}-{version}-{_tag()}.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") or ".so." in name else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return wheel


def get_requires_for_build_wheel(config_settings=None):
    return []
