"""The names engine/comm.py and engine/schedule.py read from the engine's vocabulary, which
lives in the core (core/vocabulary.py) because the cost model prices the same names.
Every other module imports core/vocabulary.py itself."""
from megatron_lbp.core.vocabulary import (DEFAULT_EMBEDDING_BACKWARD_GATHER,  # noqa: F401
                                          EMBEDDING_BACKWARD_GATHERS, MAX_PENDING_REDUCES, PHASES)
