"""`python -m megatron_lbp.demo`: the README's main job (demo/cli.py)."""
import sys

from megatron_lbp.demo.cli import main

sys.exit(main())
