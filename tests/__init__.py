"""The test suite; its folders mirror the code: kernels/, runtime/, common/, tools/, bench/,
deploy/ (launch recipes and Docker files). Shared fixtures live in conftest.py."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
