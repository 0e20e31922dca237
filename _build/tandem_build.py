"""Tandem's PEP 517 build backend: setuptools' own, plus building ggml for the CPU engine.

The CPU engine's default kernels (engine/config.py, `cpu_kernels="auto"`) run decode steps as
ggml graphs when libggml is built on this machine. Building it needs cmake, a compiler and the
package index (for ggml's sources and, where the machine has none, cmake itself), which a
serving machine may lack, so it happens here, when
Tandem is installed (`pip install .` or `pip install -e .`), and never while a server starts.
It is best effort: without a compiler or network the install still succeeds, the reason is
recorded, and the engine runs eager and says why at start (engine/model/ggml_build.py). The
torch op library is built at the engine's first start instead, against the torch installed by
then: pip's isolated build environment has no torch.

Everything else is `setuptools.build_meta`'s. The builder is loaded from the source tree by
path, because importing the `tandem.engine.model` package would import torch.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 (every other hook is setuptools')

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _build_ggml() -> None:
    if str(ROOT) not in sys.path:  # `tandem.engine.config` (cache_root) from the source tree
        sys.path.insert(0, str(ROOT))
    model = ROOT / "engine" / "model"
    _load("tandem.engine.model.file_lock", model / "file_lock.py")
    builder = _load("tandem.engine.model.ggml_build", model / "ggml_build.py")
    print(builder.build_at_install(), file=sys.stderr, flush=True)


def _build_tools() -> list[str]:
    """Build tools pip installs into the isolated build environment where this machine lacks
    them: cmake (and ninja where there is no make) come as wheels from the package index, so a
    machine with a C++ compiler needs nothing else to get ggml (the approach of scikit-build-core)."""
    tools = [] if shutil.which("cmake") else ["cmake>=3.21"]
    return tools + ([] if shutil.which("make") or shutil.which("ninja") else ["ninja"])


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _build_tools()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _build_tools()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_ggml()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_ggml()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
