"""simkv's validation against vLLM: the scenario's requests served by a vLLM engine on the GPU.

    requests.py     the scenario's requests as vLLM prompts and sampling settings (no vLLM)
    engine_args.py  the scenario's cache and scheduler settings as vLLM engine arguments (no vLLM)
    results.py      what a pass recorded -> requests.csv, steps.csv, summary.json (no vLLM)
    driver.py       the vLLM engine in process (AsyncLLM): warm-up, the saturated pass, the
                    real-time pass, the measurement folder `simkv validate compare` reads

Only driver.py imports vLLM (and, through it, torch); the rest runs on any CPU. Nothing here
imports simpy: the GPU machine has none.
"""
