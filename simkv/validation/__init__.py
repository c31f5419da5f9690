"""Validation of the simulator against the real engine, on the same requests.

Split by machine, because the GPU machine has no SimPy:

    data         what both halves share: the scenario's request window, its fingerprint, and
                 the measurement folder (runs, reading, writing); simpy-free
    measure      GPU side, simpy-free: the engine serves the requests, saturated then real time
    compare      CPU side: the simulator serves the same requests; errors, sizing, JSON
    metrics      relative errors, the issue's bounds, the results table
    diagnostics  per-step error of the cost model on the engine's own plans
    plots        TTFT/TPOT CDFs and the per-request e2e scatter

`simkv.validate` is the command line (`python -m simkv.validate prepare|measure|compare`) and
`simkv validate`'s `validate_command`; it re-exports the names above.
"""
