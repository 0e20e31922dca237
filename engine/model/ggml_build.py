"""Getting ggml onto this machine: its sources, and libggml built from them with cmake.

ggml is not on PyPI as a binary, so Tandem builds it from the sources vendored in
llama-cpp-python's sdist (the version `LLAMA_CPP_PYTHON` pins), with `-march=native`: about a
minute on two cores. That happens when Tandem is installed (the in-tree build backend,
_build/tandem_build.py, calls `build_at_install`) or when asked
(`python -m tandem.engine.model.ggml_kernels build`), never while a server starts: a serving
machine may have no compiler and no package index. The torch op library that calls into ggml is
built separately, against the torch in use (engine/model/ggml_kernels.py).

This module imports neither torch nor anything outside the standard library (and Tandem's cache
directory and file lock), because the build backend runs it in pip's isolated build environment, before torch is
installed. libggml belongs to the CPU it was built for, not to a torch version, so its folder is
keyed by the CPU's flags only. `$TANDEM_GGML_SOURCE` names an unpacked llama.cpp (or ggml) tree
to build from instead of downloading the sdist.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from tandem.engine.config import cache_root

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
_SDIST = "llama_cpp_python-0.3.36.tar.gz"  # the pin's source distribution and its sha256 (PyPI's)
_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_LIBRARIES = ("libggml-base.so", "libggml-cpu.so")
_INSTALL_NOTE = "install-note.txt"  # why the build at install time did not happen


def _cpu_key() -> str:
    """The CPU's architecture and flags: the build uses -march=native, so it belongs to this CPU."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def ggml_dir() -> Path:
    """This CPU's ggml build: libggml (`libs_dir()`) and, beside it, the op libraries per torch version."""
    return cache_root() / "ggml" / f"{LLAMA_CPP_PYTHON.replace('==', '-')}-{_cpu_key()}"


def libs_dir() -> Path:
    return ggml_dir() / "build" / "src"


def include_dir() -> Path:
    return source_tree() / "include"


def is_built() -> bool:
    return all((libs_dir() / name).is_file() for name in _LIBRARIES)


def missing_tools() -> list[str]:
    """libggml's build tools not on PATH (cmake, the C++ compiler)."""
    return [tool for tool in ("cmake", os.environ.get("CXX", "c++")) if shutil.which(tool) is None]


def install_note() -> str | None:
    """Why building ggml at install time failed, as recorded then; None when it did not fail."""
    note = ggml_dir() / _INSTALL_NOTE
    return note.read_text().strip() if note.is_file() else None


def source_tree() -> Path:
    """The ggml sources: `$TANDEM_GGML_SOURCE` (a llama.cpp or ggml tree), else those of the sdist
    unpacked under the cache directory (`fetch_sources` puts them there)."""
    explicit = os.environ.get("TANDEM_GGML_SOURCE")
    if explicit:
        root = Path(explicit).expanduser()
        tree = root / "ggml" if (root / "ggml" / "CMakeLists.txt").is_file() else root
        if not (tree / "CMakeLists.txt").is_file():
            raise FileNotFoundError(f"TANDEM_GGML_SOURCE={explicit} holds no ggml/CMakeLists.txt")
        return tree
    return cache_root() / "ggml" / "src" / LLAMA_CPP_PYTHON.replace("==", "-") / "ggml"


def fetch_sources() -> Path:
    """The ggml sources, downloading the pinned sdist from PyPI and unpacking its ggml folder the
    first time. The sdist is fetched as a file, not with `pip download`, which would also build the
    package's metadata, and which pip's isolated build environment (the build backend) hides."""
    tree = source_tree()
    if (tree / "CMakeLists.txt").is_file():
        return tree
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _download_sdist(Path(tmp))
        marker = "/vendor/llama.cpp/ggml/"
        staging = tree.with_name(tree.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if marker in m.name and (m.isfile() or m.isdir())]
            for member in members:
                member.name = member.name.split(marker, 1)[1]
            members = [m for m in members if _inside(m.name)]
            if hasattr(tarfile, "data_filter"):  # Python 3.12, 3.11.4 and later
                archive.extractall(staging, members=members, filter="data")
            else:  # plain files and folders under relative paths only, checked above
                archive.extractall(staging, members=members)
        tree.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(tree)
    return tree


def _inside(name: str) -> bool:
    """Whether an archive member's path stays inside the folder it is unpacked into."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def _download_sdist(folder: Path) -> Path:
    """The pinned sdist, found through PyPI's simple index (PEP 691 JSON) and checked against its sha256."""
    index = f"https://pypi.org/simple/{LLAMA_CPP_PYTHON.split('==')[0]}/"
    path = folder / _SDIST
    try:
        request = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            url = next(f["url"] for f in json.load(response)["files"] if f["filename"] == _SDIST)
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (OSError, KeyError, StopIteration, ValueError) as exc:
        raise RuntimeError(f"downloading {_SDIST} (ggml's sources) from {index} failed ({exc!r}); "
                           "TANDEM_GGML_SOURCE can name a llama.cpp tree to build from instead") from None
    if digest.hexdigest() != _SDIST_SHA256:
        raise RuntimeError(f"{_SDIST} from {index} does not have the pinned sha256; not building from it")
    return path


def build_ggml() -> Path:
    """libggml-base and libggml-cpu (shared, -march=native, OpenMP), fetching the sources first if
    needed; returns their folder. Raises RuntimeError saying what is missing or what failed."""
    if is_built():
        return libs_dir()
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"building ggml needs {' and '.join(missing)} on PATH")
    tree = fetch_sources()
    pc = tree / "ggml.pc.in"
    if not pc.exists():  # the sdist leaves out the pkg-config template that configuring expects
        pc.write_text("")
    out = ggml_dir() / "build"
    configure = ["cmake", "-S", str(tree), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
                 "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
                 "-DGGML_CCACHE=OFF"]
    if shutil.which("make") is None and shutil.which("ninja"):  # the build backend's ninja wheel
        configure += ["-G", "Ninja"]
    compile_ = ["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2), "--target", "ggml-base", "ggml-cpu"]
    for cmd in (configure, compile_):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building ggml failed ({' '.join(cmd[:2])}): {done.stdout[-1500:]}{done.stderr[-1500:]}")
    (ggml_dir() / _INSTALL_NOTE).unlink(missing_ok=True)
    return libs_dir()


def build_at_install() -> str:
    """Best effort, for the build backend: build libggml, or record why not (the engine then runs
    eager and says so at start) and carry on; the install never fails for ggml. Returns a line for
    the install log."""
    from tandem.engine.model.file_lock import file_lock

    try:
        ggml_dir().mkdir(parents=True, exist_ok=True)
        with file_lock(ggml_dir() / ".build.lock"):
            return f"ggml: built in {build_ggml()}"
    except Exception as exc:  # no compiler, no network, a failed build: none of them fails the install
        reason = f"{type(exc).__name__}: {str(exc)[:600]}"
        try:
            (ggml_dir() / _INSTALL_NOTE).write_text(reason + "\n")
        except OSError:
            pass
        return f"ggml: not built at install ({reason}); CPU engines run eager"
