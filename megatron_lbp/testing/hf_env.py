"""transformers for the tests, without putting it where training processes import it.

megatron-core imports transformers whenever it builds a tokenizer (its
HuggingFace and chat-template libraries try the import), which costs every
training process about 3 s of CPU (measured: ``python -c "import transformers;
from transformers import AutoTokenizer"``, 3.1-3.6 s user on the 2-core
machine); the suite starts hundreds of them. ``scripts/install.sh --test``
therefore installs transformers into its own directory, ``.venv/hf-test``
(``pip install --target``, with only the requirements the venv lacks: the rest
come from the venv), which only the tests that need it append to ``sys.path``
(last, so the venv's own packages win) or hand to a rank through
``PYTHONPATH``. ``LBP_HF_TEST_PATH`` points elsewhere.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def path() -> str:
    return os.environ.get("LBP_HF_TEST_PATH", str(REPO / ".venv" / "hf-test"))


def transformers():
    """The transformers module; a one-line error naming the install step when it is missing."""
    extra = path()
    if os.path.isdir(extra) and extra not in sys.path:
        sys.path.append(extra)
    try:
        import transformers as tf
    except ImportError as err:
        raise RuntimeError(f"transformers is not importable ({err}); the Hugging Face tests take it "
                           f"from {extra}: run bash scripts/install.sh --test") from None
    return tf
