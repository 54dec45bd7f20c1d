"""bench/fleet.py's pure helpers: the gateway's body split into one Pushgateway group per
node (the same series on both sides of the comparison), and the samples counted alike."""

from __future__ import annotations

from bench.fleet import per_node_groups, samples_in

BODY = b"""# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="a"} 5
DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="b"} 7
# HELP DCGM_CUSTOM_PROCESS_SM_UTIL SM utilisation of a process.
# TYPE DCGM_CUSTOM_PROCESS_SM_UTIL gauge
DCGM_CUSTOM_PROCESS_SM_UTIL{NodeName="b",pid="1"} 3
# HELP gpurelay_gateway_channels Open telemetry channels.
# TYPE gpurelay_gateway_channels gauge
gpurelay_gateway_channels 2
"""


def test_each_node_gets_its_lines_under_their_headers_and_the_gateways_own_stay_out() -> None:
    groups = per_node_groups(BODY)
    assert set(groups) == {"a", "b"}
    assert groups["a"] == (
        b"# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n"
        b"# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        b'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="a"} 5\n'
    )
    assert groups["b"].count(b"# TYPE") == 2
    assert b'NodeName="b",pid="1"} 3' in groups["b"]
    assert sum(samples_in(g) for g in groups.values()) == samples_in(BODY) == 3


def test_the_pushgateways_own_series_are_not_node_samples() -> None:
    served = BODY + b'push_time_seconds{Hostname="a",job="gpurelay"} 1.7e9\n'
    assert samples_in(served) == 3
