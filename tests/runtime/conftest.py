import sys
from pathlib import Path

# The multi-rank launcher lives one level up and is shared with other test folders.
_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
