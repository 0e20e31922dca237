"""Tandem's one import namespace: `tandem.engine`, `tandem.routing`, `tandem.actors`, `tandem.cluster`.

The layers live in the repository's top-level folders (`engine/`, `routing/`, `actors/`,
`cluster/`), which is where a reader looks for them. Installing maps them under this package
(pyproject.toml's `package-dir`), so site-packages gains only `tandem` and nothing generic like
`engine` that could collide with another project. In a source checkout that is not installed (a
copy of the tree on another machine, `PYTHONPATH=.`), this package's search path also covers the
checkout root, so `tandem.engine` resolves to `./engine` without an install step. `bench/` is
not part of the product: it runs from a checkout as `python -m bench.…` or `tandem bench`.
"""

from pathlib import Path

_CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
if (_CHECKOUT_ROOT / "pyproject.toml").is_file() and (_CHECKOUT_ROOT / "routing" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT_ROOT))  # noqa: F821 (a package's __path__)
