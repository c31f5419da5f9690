"""The collectives of a tensor-parallel step: its all-reduces and the LM head's gather, in seconds.

A step of a replica split over p GPUs (simkv.parallel) runs, as vLLM's Llama-style models do:
- one all-reduce of the vocab-parallel embedding's partial rows,
- two per decoder layer, after the attention's o_proj and after the MLP's (or the experts')
  down projection, row-parallel layers whose partial outputs the ranks sum,
each of rows x hidden_size x 2 bytes (bf16 activations), and one all-gather of the sampled
rows' logits (rows x padded vocabulary x 2 bytes gathered). A ring all-reduce of B bytes moves
2 (p - 1) / p x B through each GPU's link, an all-gather (p - 1) / p of the bytes gathered:

    all_reduce(B) = latency + 2 (p - 1) / p x B / bandwidth
    all_gather(B) = all_reduce(B / 2)

The figures are the link's (profiles/links.yaml: `nvlink` inside one 8-GPU board, `ib-ndr`
beyond, its bandwidth and allreduce_latency_s). A profile that measured all-reduce times per
message size (`allreduce.csv` beside its fit, written by the profiler on every rank) gives them
instead: the median per size, linear between measured sizes, the first size's time below it, and
beyond the largest the bandwidth its last two sizes show.
"""
from __future__ import annotations

import bisect
import csv
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from simkv.errors import InputError
from simkv.parallel import padded_vocab_rows

ACTIVATION_BYTES = 2            # bf16 rows
ALLREDUCE_FILE = "allreduce.csv"
NODE_GPUS = 8                   # GPUs one NVSwitch board joins; beyond it the network


@dataclass(frozen=True)
class AllReduce:
    """Seconds of one all-reduce over `ranks` GPUs: measured (`sizes`, `seconds_at`) or from
    the link's bandwidth (bytes/s, one direction) and latency."""

    ranks: int
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str
    sizes: tuple = ()            # measured message sizes, bytes, increasing
    seconds_at: tuple = ()       # their median seconds

    def seconds(self, num_bytes: float) -> float:
        """Seconds of an all-reduce of `num_bytes` bytes (each rank's message)."""
        sizes = self.sizes
        if not sizes:
            p = self.ranks
            return self.latency_s + 2 * (p - 1) / p * num_bytes / self.bandwidth_bytes_per_s
        if num_bytes <= sizes[0] or len(sizes) == 1:
            return self.seconds_at[0]
        i = min(bisect.bisect_left(sizes, num_bytes), len(sizes) - 1)
        f = (num_bytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return self.seconds_at[i - 1] + f * (self.seconds_at[i] - self.seconds_at[i - 1])

    def gather_seconds(self, num_bytes: float) -> float:
        """Seconds of an all-gather whose result is `num_bytes` bytes on every rank."""
        return self.seconds(num_bytes / 2)

    def describe(self) -> dict:
        out = {"ranks": self.ranks, "source": self.source}
        if self.sizes:
            out["measured"] = {"message_bytes": list(self.sizes),
                               "seconds": list(self.seconds_at)}
        else:
            out.update(bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
                       latency_s=self.latency_s)
        return out


def link_allreduce(tensor_parallel_size: int) -> AllReduce:
    """The all-reduce of a replica from the bundled link figures: NVLink within one board,
    InfiniBand NDR when the replica spans boards."""
    from simkv.config.cluster import load_link, read_links
    name = "nvlink" if tensor_parallel_size <= NODE_GPUS else "ib-ndr"
    link = load_link(name)
    figure = (read_links().get(name) or {}).get("allreduce_latency_s")
    value = figure.get("value") if isinstance(figure, dict) else figure
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InputError(f"profiles/links.yaml: {name}.allreduce_latency_s: expected a number "
                         f">= 0, got {value!r}")
    return AllReduce(tensor_parallel_size, link.bandwidth_bytes_per_s, float(value),
                     f"links.yaml {name} (ring all-reduce from its bandwidth and latency)")


def read_measured(path: Path, tensor_parallel_size: int) -> Optional[AllReduce]:
    """The all-reduce measured in `path` (columns message_bytes, seconds; any others, such as
    rank and repeat, are ignored), or None when the file does not exist."""
    if not path.is_file():
        return None
    by_size: dict = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"message_bytes", "seconds"} <= set(reader.fieldnames):
            raise InputError(f"{path}: expected columns message_bytes and seconds")
        for line, row in enumerate(reader, start=2):
            try:
                size, seconds = int(row["message_bytes"]), float(row["seconds"])
            except (TypeError, ValueError):
                raise InputError(f"{path}: row {line}: message_bytes must be an integer and "
                                 f"seconds a number, got {row['message_bytes']!r}, "
                                 f"{row['seconds']!r}") from None
            if size <= 0 or not seconds > 0:
                raise InputError(f"{path}: row {line}: message_bytes and seconds must be > 0")
            by_size.setdefault(size, []).append(seconds)
    if not by_size:
        raise InputError(f"{path}: no measurements")
    sizes = tuple(sorted(by_size))
    seconds = tuple(statistics.median(by_size[s]) for s in sizes)
    return AllReduce(tensor_parallel_size, 0.0, 0.0, f"measured: {path}", sizes, seconds)


class StepCollectives:
    """Seconds of one step's collectives on a model split over `allreduce.ranks` GPUs."""

    def __init__(self, model, allreduce: AllReduce):
        self.allreduce = allreduce
        self.num_allreduces = 2 * model.num_layers + 1
        self.row_bytes = model.hidden_size * ACTIVATION_BYTES
        tp = allreduce.ranks
        self.logit_row_bytes = padded_vocab_rows(model.vocab_size, tp) * tp * ACTIVATION_BYTES
        self._reduces: dict = {}        # rows -> seconds of the step's all-reduces
        self._gathers: dict = {}        # sampled rows -> seconds of the logits' gather

    def seconds(self, rows: int, sampled: int) -> float:
        """The all-reduces of `rows` rows and the gather of `sampled` rows' logits."""
        reduces = self._reduces.get(rows)
        if reduces is None:
            reduces = self._reduces[rows] = self.num_allreduces * self.allreduce.seconds(
                rows * self.row_bytes)
        if not sampled:
            return reduces
        gather = self._gathers.get(sampled)
        if gather is None:
            gather = self._gathers[sampled] = self.allreduce.gather_seconds(
                sampled * self.logit_row_bytes)
        return reduces + gather

    def describe(self) -> dict:
        return {**self.allreduce.describe(), "allreduces_per_step": self.num_allreduces,
                "bytes_per_row": self.row_bytes, "logit_bytes_per_sampled_row":
                self.logit_row_bytes}
