import os
import sys

# The oracle lives beside the tests; the package is installed (or on the path from the repo root).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
