"""The `cluster:` section of a scenario: pools of replicas behind a router, and the link that
carries KV from prefill to decode replicas.

```yaml
cluster:
  router: {policy: round_robin, refresh_s: 0.0}
  pools:
    - {name: main, replicas: 4, role: mixed}      # replicas main-0 .. main-3
    - {name: big, replicas: 2, gpu: h100, cache: {block_size: 32}}
  kv_transfer: {link: nvlink}                     # P/D only; or {bandwidth_gbps, latency_s}
```

Each pool is the scenario with the pool's overrides (`gpu`, `model`, `cost_model`,
`tensor_parallel_size`, `cache`, `scheduler`) applied and validated like any scenario, so a pool whose GPU cannot hold the model
fails here, naming `cluster.pools.N`. Link figures come from `profiles/links.yaml`
(`load_link`). Every problem is an InputError naming the file (or --set) and the key.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from simkv.config.keys import LINK_TYPES, POOL_SECTIONS, POOL_TYPES, ROUTER_TYPES, check_key
from simkv.errors import InputError, read_yaml_mapping
from simkv.specs import profiles_dir

ROLES = ("mixed", "prefill", "decode")
POLICIES = ("round_robin", "random", "least_requests", "least_kv", "prefix_affinity",
            "kv_aware")
# routers whose choice depends on nothing but the arrival order (and a seed): the assignment
# is known before the run (simkv.sim.cluster.router)
STATE_INDEPENDENT = ("round_robin", "random")
GBPS = 1e9 / 8                  # bytes per second in one gigabit per second


@dataclass
class RouterConfig:
    policy: str = "round_robin"
    refresh_s: float = 0.0        # the router sees replica state as of its last refresh (0: live)
    seed: Optional[int] = None    # random: its seed (default: the scenario's)
    prefix_blocks: int = 2        # prefix_affinity: prompt blocks (trace prefix blocks) hashed
    load_factor: float = 1.25     # prefix_affinity: a replica takes a request while its load
                                  # is at most load_factor x the mean (bounded loads)
    virtual_nodes: int = 64       # prefix_affinity: points per replica on the hash ring
    prefix_weight: float = 2.0    # kv_aware: weight of the prompt's cached fraction
    queue_weight: float = 1.0     # kv_aware: weight of the queue term (1 - queue / longest)
    kv_weight: float = 1.0        # kv_aware: weight of the free KV fraction


@dataclass
class LinkConfig:
    """A KV transfer link: `seconds(bytes) = latency_s + bytes / bandwidth_bytes_per_s`."""
    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    sources: dict = field(default_factory=dict)

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass
class PoolConfig:
    name: str
    replicas: int
    role: str                     # mixed | prefill | decode
    scenario: Any                 # the Scenario each of its replicas serves (overrides applied)


@dataclass
class ClusterConfig:
    pools: list
    router: RouterConfig
    kv_transfer: Optional[LinkConfig] = None

    @property
    def disaggregated(self) -> bool:
        return any(p.role != "mixed" for p in self.pools)

    @property
    def num_replicas(self) -> int:
        return sum(p.replicas for p in self.pools)


def read_links() -> dict:
    """`profiles/links.yaml` as a mapping of link name to its entry."""
    return read_yaml_mapping(profiles_dir() / "links.yaml", "link name to figures")


def load_link(name: str) -> LinkConfig:
    """A bundled link (`nvlink`, `ib-ndr`, `pcie-gen5`, ...) from `profiles/links.yaml`."""
    links = read_links()
    path = profiles_dir() / "links.yaml"
    if name not in links:
        raise InputError(f"unknown link {name!r}: bundled links are {', '.join(links)}")
    entry = links[name] or {}
    values, sources = {}, {}
    for key in ("bandwidth_bytes_per_s", "latency_s"):
        figure = entry.get(key)
        value = figure.get("value") if isinstance(figure, dict) else figure
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                or (key == "bandwidth_bytes_per_s" and value == 0):
            raise InputError(f"{path}: {name}.{key}: expected a positive number, got {value!r}")
        values[key] = float(value)
        if isinstance(figure, dict) and figure.get("source"):
            sources[key] = str(figure["source"])
    return LinkConfig(name, values["bandwidth_bytes_per_s"], values["latency_s"], sources)


def load_cluster(raw: dict, v, source: str, load_pool) -> Optional[ClusterConfig]:
    """The scenario's ClusterConfig, or None without a `cluster:` section.

    `v` is the scenario's Validator (names the file or --set), `load_pool(raw, source)` loads
    a pool's scenario from the scenario dict with the pool's overrides."""
    section = raw.get("cluster")
    if section is None:
        return None
    if not isinstance(section, dict):
        v.fail("cluster", f"expected a mapping with pools (and router, kv_transfer), got "
                          f"{section!r}")
    for key in section:
        check_key(f"cluster.{key}", source)
    router = _router(v, section.get("router"))
    pools_raw = section.get("pools")
    if not isinstance(pools_raw, list) or not pools_raw:
        v.fail("cluster.pools", "expected a list of pools ({name, replicas, role}), got "
                                f"{pools_raw!r}")
    base = {k: copy.deepcopy(val) for k, val in raw.items() if k != "cluster"}
    pools, names = [], set()
    for i, entry in enumerate(pools_raw):
        pool = _pool(v, i, entry, base, source, load_pool)
        if pool.name in names:
            v.fail(f"cluster.pools.{i}.name", f"{pool.name!r} is the name of an earlier pool")
        names.add(pool.name)
        pools.append(pool)
    roles = {p.role for p in pools}
    if "mixed" in roles and len(roles) > 1:
        v.fail("cluster.pools", "mixed pools cannot be combined with prefill/decode pools "
                                "(every pool mixed, or prefill and decode pools only)")
    if "decode" in roles and "prefill" not in roles:
        name = next(p.name for p in pools if p.role == "decode")
        v.fail("cluster.pools", f"decode pool {name!r} has no prefill pool to take requests "
                                "from (add a pool with role: prefill)")
    if "prefill" in roles and "decode" not in roles:
        name = next(p.name for p in pools if p.role == "prefill")
        v.fail("cluster.pools", f"prefill pool {name!r} has no decode pool to hand requests "
                                "to (add a pool with role: decode)")
    link = _link(v, section.get("kv_transfer"))
    if "prefill" in roles and link is None:
        v.fail("cluster.kv_transfer", "missing: prefill/decode pools need a link "
                                      "({link: nvlink} or {bandwidth_gbps, latency_s})")
    return ClusterConfig(pools, router, link)


def _typed(v, key: str, value: Any, types: dict, name: str):
    """`value` of the cluster key `key` checked as the scenario's keys are (Validator.typed:
    its type, and a number against its rule in simkv.limits)."""
    return v.typed(key, value, types[name])


def _router(v, section) -> RouterConfig:
    if section is None:
        return RouterConfig()
    if not isinstance(section, dict):
        v.fail("cluster.router", f"expected a mapping like {{policy: round_robin}}, got "
                                 f"{section!r}")
    for key in section:
        check_key(f"cluster.router.{key}", v.source)
    values = {k: _typed(v, f"cluster.router.{k}", val, ROUTER_TYPES, k)
              for k, val in section.items()}
    router = RouterConfig(**values)
    if router.policy not in POLICIES:
        v.fail("cluster.router.policy", f"{router.policy!r} is not one of {', '.join(POLICIES)}")
    return router


def _pool(v, i: int, entry, base: dict, source: str, load_pool) -> PoolConfig:
    where = f"cluster.pools.{i}"
    if not isinstance(entry, dict):
        v.fail(where, f"expected a mapping like {{name: main, replicas: 2}}, got {entry!r}")
    for key, value in entry.items():
        check_key(f"{where}.{key}", source)
        if key in POOL_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                v.fail(f"{where}.{key}", f"expected a mapping, got {value!r}")
            for sub in value:
                check_key(f"{where}.{key}.{sub}", source)
    name = _typed(v, f"{where}.name", entry.get("name", f"pool{i}"), POOL_TYPES, "name")
    if not name or any(c.isspace() or c in ",/" for c in name):
        v.fail(f"{where}.name", f"{name!r}: expected a non-empty name without spaces, commas or "
                                "slashes (replicas are named <pool>-<index>)")
    if "replicas" not in entry:
        v.fail(f"{where}.replicas", "missing (how many replicas the pool has, >= 1)")
    replicas = _typed(v, f"{where}.replicas", entry["replicas"], POOL_TYPES, "replicas")
    role = _typed(v, f"{where}.role", entry.get("role", "mixed"), POOL_TYPES, "role")
    if role not in ROLES:
        v.fail(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    merged = copy.deepcopy(base)
    for key in ("gpu", "model", "cost_model", "tensor_parallel_size"):
        if entry.get(key) is not None:
            merged[key] = _typed(v, f"{where}.{key}", entry[key], POOL_TYPES, key)
    for key in POOL_SECTIONS:
        if entry.get(key):
            merged[key] = {**(merged.get(key) or {}), **entry[key]}
    scenario = load_pool(merged, f"{v.source}: {where} ({name})")
    return PoolConfig(name, replicas, role, scenario)


def _link(v, section) -> Optional[LinkConfig]:
    if section is None:
        return None
    if not isinstance(section, dict):
        v.fail("cluster.kv_transfer", f"expected {{link: NAME}} or {{bandwidth_gbps, "
                                      f"latency_s}}, got {section!r}")
    for key in section:
        check_key(f"cluster.kv_transfer.{key}", v.source)
    values = {k: _typed(v, f"cluster.kv_transfer.{k}", val, LINK_TYPES, k)
              for k, val in section.items()}
    if values.get("link") is not None:
        try:
            link = load_link(values["link"])
        except InputError as e:
            v.fail("cluster.kv_transfer.link", str(e))
    else:
        if values.get("bandwidth_gbps") is None:
            v.fail("cluster.kv_transfer.bandwidth_gbps",
                   "missing: a link needs its bandwidth (gigabits/s), or name a bundled one "
                   f"with cluster.kv_transfer.link ({', '.join(read_links())})")
        link = LinkConfig("custom", 0.0, 0.0)
    if values.get("bandwidth_gbps") is not None:
        link.bandwidth_bytes_per_s = values["bandwidth_gbps"] * GBPS
        link.sources["bandwidth_bytes_per_s"] = "the scenario's cluster.kv_transfer"
    if values.get("latency_s") is not None:
        link.latency_s = values["latency_s"]
        link.sources["latency_s"] = "the scenario's cluster.kv_transfer"
    return link


def cluster_to_dict(cluster: ClusterConfig) -> dict:
    """The cluster as plain data, for reports."""
    return {"router": {f.name: getattr(cluster.router, f.name) for f in fields(RouterConfig)},
            "pools": [{"name": p.name, "replicas": p.replicas, "role": p.role,
                       "gpu": p.scenario.gpu.name, "model": p.scenario.model.name,
                       **({"tensor_parallel_size": p.scenario.tensor_parallel_size}
                          if p.scenario.tensor_parallel_size != 1 else {})}
                      for p in cluster.pools],
            "kv_transfer": None if cluster.kv_transfer is None else {
                "link": cluster.kv_transfer.name,
                "bandwidth_bytes_per_s": cluster.kv_transfer.bandwidth_bytes_per_s,
                "latency_s": cluster.kv_transfer.latency_s}}
