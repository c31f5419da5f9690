"""What a profile measures: its parts, and the settings that several of them share."""
from __future__ import annotations

PARTS = ("steps", "transfers", "ledger", "host_noise", "engine")      # the default set
OPTIONAL_PARTS = ("rested", "serving")
LEDGER_BLOCK_SIZE = 16       # the block size at which the ledger and the host noise are measured
MAX_NUM_SEQS = 256           # the engine's max_num_seqs that the profiling executor is built for
GIB = 1 << 30
