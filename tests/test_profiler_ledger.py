"""The profiler's ledger part compares its measurement with simkv.sizing's estimate at fixed
settings, for dense and MoE models alike (a bare SchedulerConfig leaves the limits unset)."""
import pytest

from simkv import sizing
from simkv.specs import load_model

pytest.importorskip("torch")

from simkv.gpu.profiler.ledger import _estimate_comparison  # noqa: E402


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_the_estimate_comparison_runs_at_the_committed_settings(name):
    model = load_model(name)
    ledger = {"weights_bytes": 10, "activation_base_bytes": 100,
              "activation_bytes_per_batched_token": 2, "other_bytes": 1000}
    found = _estimate_comparison(model, ledger)
    assert (found["max_num_batched_tokens"], found["max_num_seqs"]) == (8192, 256)
    assert found["measured"]["activation_bytes"] == 100 + 2 * 8192
    estimate = found["estimate"]["activation_bytes"]
    assert estimate > 0
    assert found["measured_minus_estimate"]["activation_bytes"] == 100 + 2 * 8192 - estimate
    assert found["estimate"]["weights_bytes"] == model.weight_bytes(sizing.WEIGHT_DTYPE_BYTES)
