"""Fixtures of the bench tests: where the devkit's files are, found rather than assumed.

The devkit (SGLang bundle, dummy models' configs, SmolLM2's tokenizer; ../shared/devkit/README.md)
is looked for in $OSCAR_TEST_DEVKIT, then the checkout's .devkit/, then shared/devkit/ beside the
checkout. A test that needs a file from it skips, saying which file and where it looked, when none
has it.
"""
import os
from pathlib import Path

import pytest

from tests import ROOT


def devkit_dirs() -> list:
    """Where a devkit may be, in the order looked at."""
    env = os.environ.get("OSCAR_TEST_DEVKIT")
    return [*([Path(env)] if env else []), ROOT / ".devkit", ROOT.parent / "shared" / "devkit"]


def find_devkit_file(relative: str):
    """The first devkit folder holding `relative`, as that path; None when none does."""
    return next((d / relative for d in devkit_dirs() if (d / relative).exists()), None)


@pytest.fixture
def smollm2_tokenizer() -> Path:
    """The devkit's SmolLM2-135M folder (tokenizer.json and its config); skips when absent."""
    found = find_devkit_file("models/smollm2-135m/tokenizer.json")
    if found is None:
        pytest.skip("needs the devkit's models/smollm2-135m/tokenizer.json (set OSCAR_TEST_DEVKIT to a "
                    f"devkit folder); looked in {', '.join(str(d) for d in devkit_dirs())}")
    return found.parent
