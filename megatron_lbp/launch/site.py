"""The site environment of a launch: Frontier's RCCL/libfabric settings, or the local one's.

The launcher exports what :func:`exports` returns: modules first, then these
defaults, then every value the user exported before ``module load``.
Sources: [P] OLCF "PyTorch on Frontier"
(docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html: the RCCL network
plugin variables, NCCL_NET, NCCL_SOCKET_IFNAME, FI_CXI_RDZV_PROTO, port 3442);
[U] OLCF Frontier User Guide (docs.olcf.ornl.gov/systems/frontier_user_guide.html:
-c 7 per GCD, OMP_NUM_THREADS). CUDA_DEVICE_MAX_CONNECTIONS is not set (these
runs are data-parallel only).
"""
from __future__ import annotations

from typing import Mapping

SITES = ("frontier", "local")


def defaults(site: str, nodes: int, cpus_per_task: str,
             rccl_net_plugin_dir: str = "") -> list[tuple[str, str]]:
    """(name, value) of the site's environment, in the order OLCF documents it."""
    if site == "local":
        return [("OMP_NUM_THREADS", "1"), ("PYTHONWARNINGS", "ignore")]
    out = [
        ("NCCL_NET", "OFI" if nodes > 1 else "Socket"),   # [P]
        ("NCCL_CROSS_NIC", "1"),                          # [P]
        ("NCCL_NET_GDR_LEVEL", "PHB"),                    # [P]
        ("NCCL_SOCKET_IFNAME", "hsn0,hsn1,hsn2,hsn3"),    # [P]
        ("HSA_FORCE_FINE_GRAIN_PCIE", "1"),               # [P]
        ("FI_MR_CACHE_MONITOR", "kdreg2"),                # [P] (never memhooks: deadlocks with the plugin)
        ("FI_CXI_DISABLE_HOST_REGISTER", "1"),            # [P]
        ("FI_CXI_DEFAULT_CQ_SIZE", "131072"),             # [P]
        ("FI_CXI_RDZV_PROTO", "alt_read"),                # [P] with #SBATCH --network=disable_rdzv_get
        ("FI_CXI_RDZV_EAGER_SIZE", "0"),                  # [P]
        ("FI_CXI_RDZV_THRESHOLD", "0"),                   # [P]
        ("FI_CXI_RDZV_GET_MIN", "0"),                     # [P]
        ("FI_CXI_DEFAULT_TX_SIZE", "2048"),               # [P]
        ("FI_CXI_RX_MATCH_MODE", "hybrid"),               # [P]
        ("OMP_NUM_THREADS", cpus_per_task or "7"),        # [U]
    ]
    # [P] "Preferred": NCCL_NET_PLUGIN names the plugin library (else the rccl-net-plugin
    # module or LD_LIBRARY_PATH provide it).
    if rccl_net_plugin_dir:
        out.append(("NCCL_NET_PLUGIN", f"{rccl_net_plugin_dir}/librccl-net.so"))
    return out


def exports(site_defaults: list[tuple[str, str]], before_modules: Mapping[str, str]
            ) -> tuple[list[tuple[str, str]], list[str]]:
    """(what to export, the names the user set): the user's values win over the defaults."""
    users = [k for k, _ in site_defaults if k in before_modules]
    return [(k, before_modules.get(k, v)) for k, v in site_defaults], users
