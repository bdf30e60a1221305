"""A cluster description: devices, memory, links and compute, read from ``conf/cluster/<name>.yaml``.

A file may start from another with ``defaults: [<name>, _self_]`` (Hydra's spelling, resolved
here by plain merging: a cluster file is read outside a Hydra composition).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

_GB = 1e9


@dataclass(frozen=True)
class Link:
    """One kind of link between devices (inside a node, or between nodes).

    Args:
        bandwidth: payload bytes per second of all-reduce and send/recv.
        gather_bandwidth: payload bytes per second of all-gather and reduce-scatter.
        latency: seconds per collective step (the alpha of an alpha-beta model).
        a2a_bandwidth: payload bytes per second of all-to-all (None: ``gather_bandwidth``, the same volume per
            link as an all-gather).
    """

    bandwidth: float
    gather_bandwidth: float
    latency: float
    a2a_bandwidth: Optional[float] = None

    @property
    def all_to_all_bandwidth(self) -> float:
        """Payload bytes per second of all-to-all (context parallelism's Ulysses method)."""
        return self.a2a_bandwidth or self.gather_bandwidth


@dataclass(frozen=True)
class Cluster:
    """What the planner knows of the machines.

    Args:
        name: the description's name.
        devices_per_node: devices (processes) per node; groups that fit in one use ``intra_node``.
        memory_per_device: bytes a rank may use.
        compute: ``measured`` (time each layer here) or ``peak`` (FLOPs / (peak x efficiency)).
        intra_node: the link inside a node.
        inter_node: the link between nodes.
        peak_flops: FLOP/s per device (``compute: peak``).
        efficiency: the share of the peak dense layers reach (``compute: peak``).
        compute_units: processes that run at full speed at once (cores of a CPU machine); None: every device.
        memory_bandwidth: bytes per second of device memory (the optimizer step is bound by it).
        oversubscribed_latency: seconds per collective step when more processes than ``compute_units`` run
            (every rank of a collective must be scheduled onto a core first).
        dtensor_param_overhead: seconds per step for each parameter held as a DTensor (FSDP2, tensor parallel):
            the Python dispatch of its hooks and optimizer update, which a small model on a CPU feels.
        pipeline_action_overhead: seconds each pipeline schedule action (a forward or backward of one stage on one
            micro-batch) costs beyond its compute.
        deepspeed_overhead_per_byte: seconds per step per byte of a replica's parameters under DeepSpeed's ZeRO
            engine beyond the same step under DDP (its copies into flat fp32 partitions and reduction buckets).
    """

    name: str
    devices_per_node: int
    memory_per_device: float
    compute: str
    intra_node: Link
    inter_node: Link
    peak_flops: Optional[float] = None
    efficiency: Optional[float] = None
    compute_units: Optional[int] = None
    memory_bandwidth: float = 100 * _GB
    oversubscribed_latency: Optional[float] = None
    dtensor_param_overhead: float = 0.0
    pipeline_action_overhead: float = 0.0
    deepspeed_overhead_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if self.compute not in ("measured", "peak"):
            raise ValueError(f"cluster {self.name!r}: compute={self.compute!r} must be 'measured' or 'peak'.")
        if self.compute == "peak" and not (self.peak_flops and self.efficiency):
            raise ValueError(
                f"cluster {self.name!r}: compute=peak needs peak_tflops and efficiency (e.g. 989 and 0.45)."
            )
        if self.devices_per_node < 1 or self.memory_per_device <= 0:
            raise ValueError(f"cluster {self.name!r}: devices_per_node and memory_per_device_gb must be positive.")

    def link(self, group_span: int, world_size: int = 1) -> Link:
        """The link a group of ``group_span`` consecutive ranks talks over (ranks are placed node by node).

        Args:
            group_span: ranks from the group's first to its last.
            world_size: processes in the run (more than ``compute_units`` raises the latency).
        """
        link = self.intra_node if group_span <= self.devices_per_node else self.inter_node
        if self.compute_units and self.oversubscribed_latency and world_size > self.compute_units:
            return Link(link.bandwidth, link.gather_bandwidth, self.oversubscribed_latency, link.a2a_bandwidth)
        return link

    def compute_slowdown(self, world_size: int) -> float:
        """How much slower each rank computes when ``world_size`` processes share ``compute_units``."""
        if not self.compute_units:
            return 1.0
        return max(1.0, world_size / self.compute_units)


def _link(values: Mapping[str, Any]) -> Link:
    bandwidth = float(values["bandwidth_gbs"]) * _GB
    gather = float(values.get("gather_bandwidth_gbs") or values["bandwidth_gbs"]) * _GB
    a2a = values.get("all_to_all_bandwidth_gbs")
    return Link(bandwidth, gather, float(values["latency_us"]) * 1e-6, float(a2a) * _GB if a2a else None)


def cluster_from_dict(values: Mapping[str, Any]) -> Cluster:
    """A :class:`Cluster` from the plain values of a cluster file (units as the files spell them).

    Args:
        values: ``name``, ``devices_per_node``, ``memory_per_device_gb``, ``compute``, ``intra_node`` and
            ``inter_node`` (``bandwidth_gbs``, ``gather_bandwidth_gbs``, ``latency_us``, optionally
            ``all_to_all_bandwidth_gbs``), and optionally
            ``peak_tflops``, ``efficiency``, ``compute_units``, ``memory_bandwidth_gbs``.
    """
    missing = [k for k in ("name", "devices_per_node", "memory_per_device_gb", "compute", "intra_node", "inter_node")
               if values.get(k) is None]
    if missing:
        raise ValueError(f"The cluster description lacks {missing}: see conf/cluster/cpu.yaml for every key.")
    peak = values.get("peak_tflops")
    return Cluster(
        name=str(values["name"]),
        devices_per_node=int(values["devices_per_node"]),
        memory_per_device=float(values["memory_per_device_gb"]) * _GB,
        compute=str(values["compute"]),
        intra_node=_link(values["intra_node"]),
        inter_node=_link(values["inter_node"]),
        peak_flops=float(peak) * 1e12 if peak else None,
        efficiency=float(values["efficiency"]) if values.get("efficiency") else None,
        compute_units=int(values["compute_units"]) if values.get("compute_units") else None,
        memory_bandwidth=float(values.get("memory_bandwidth_gbs") or 100) * _GB,
        oversubscribed_latency=(
            float(values["oversubscribed_latency_us"]) * 1e-6 if values.get("oversubscribed_latency_us") else None
        ),
        dtensor_param_overhead=float(values.get("dtensor_param_overhead_us") or 0.0) * 1e-6,
        pipeline_action_overhead=float(values.get("pipeline_action_overhead_us") or 0.0) * 1e-6,
        deepspeed_overhead_per_byte=float(values.get("deepspeed_overhead_ns_per_byte") or 0.0) * 1e-9,
    )


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A cluster file's values, with the files its ``defaults`` name merged underneath."""
    from omegaconf import OmegaConf

    if path in seen:
        raise ValueError(f"Cluster files include each other in a loop: {[str(p) for p in (*seen, path)]}.")
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    merged = OmegaConf.create()
    for base in values.pop("defaults", None) or []:
        if base != "_self_":
            merged = OmegaConf.merge(merged, _read(path.parent / f"{base}.yaml", (*seen, path)))
    return OmegaConf.to_container(OmegaConf.merge(merged, values), resolve=True)


def load_cluster(name_or_path: str, config_dir: Path) -> Cluster:
    """The cluster ``conf/cluster/<name>.yaml`` (or a YAML file at a path).

    Args:
        name_or_path: a file name of ``<config_dir>/cluster`` without ``.yaml``, or a path to a YAML file.
        config_dir: the suite's Hydra config folder.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = config_dir / "cluster" / f"{name_or_path}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in (config_dir / "cluster").glob("*.yaml"))
        raise ValueError(
            f"No cluster description {name_or_path!r} ({path}): use one of {shipped} or a YAML file's path."
        )
    return cluster_from_dict(_read(path))
