"""Fleets: the replicas of a scenario's `cluster:` pools on one SimPy clock, behind a router
(`fleet`), with prefill/decode hand-offs over a link (`disagg`) and the fleet's summary
(`summary`)."""
