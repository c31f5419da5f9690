"""The profile folder's format: file names, format tags and the settings that the profiler
(simkv.gpu) and the fits (simkv.fitting) and cost models (simkv.costmodel) must agree on."""
from __future__ import annotations

FIT_FILE = "fit.json"
FIT_FORMAT = "simkv-fit/2"     # every step and layout key present (fits of /1 may lack some)
CLOCK_FILE = "clock.json"
CLOCK_FORMAT = "simkv-clock-1"
SHARED_READS_FILE = "shared_reads.json"
SHARED_READS_FORMAT = "simkv-shared-reads-1"

# The engine and serving passes serve at this block size (their host terms are fitted at it).
ENGINE_PASS_BLOCK_SIZE = 16
