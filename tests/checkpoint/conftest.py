import sys
from pathlib import Path

# The multi-rank launcher lives one level up and is shared with other test folders; the
# tensor-parallel checkpoint tests build their models with tests/runtime/test_mesh_tp.py.
_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parent), str(_HERE.parent / "runtime")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
