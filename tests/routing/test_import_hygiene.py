"""`routing/` stays pure: importing all of it loads neither ray, torch nor numpy."""

import subprocess
import sys
from pathlib import Path

ROUTING = Path(__file__).resolve().parents[2] / "routing"


def test_routing_imports_no_ray_torch_or_numpy():
    modules = sorted(f"tandem.routing.{p.stem}" for p in ROUTING.glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in ["tandem.routing", *modules])
        + "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROUTING.parent, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
