"""What the tests (``tests/``) and the benchmarks (``bench/``) share; not shipped.

A bench never imports from ``tests/`` and nothing here does either
(``tests/test_layering.py`` checks both): what both need lives in this package. It is not
in the wheel (``pyproject.toml`` packages ``gpurelay``, ``edge_agent`` and
``cloud_gateway`` only); tests and benches import it from the repository root. pytest
fixtures and skip logic stay in ``tests/conftest.py``.

- :mod:`harness.ports`: free loopback ports
- :mod:`harness.waiting`: ``wait_until`` (blocking) and ``wait_for`` (async), with a deadline
- :mod:`harness.process`: one child process: start, stop, kill -9, CPU and RSS, its log
- :mod:`harness.services`: the gateway and agent binaries as such processes
- :mod:`harness.prometheus`: a real Prometheus remote-write receiver; the completeness check
- :mod:`harness.fleet`: a throwaway fleet PKI; gateways and agents run in this process
- :mod:`harness.pipeline`: the agent's pipeline over the NVML simulator, with a fixed clock
- :mod:`harness.protos`: the pod-resources gRPC stubs from their ``.proto`` (``make protos``)
- :mod:`harness.netns`: a real uplink: the agent in its own network namespace behind a
  router namespace that can make the link silent or lossy (root, iproute2, iptables)
"""
