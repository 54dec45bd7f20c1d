"""The kubelet's PodResources API (v1): which container holds which device.

The kubelet serves it over gRPC on ``/var/lib/kubelet/pod-resources/kubelet.sock``.

- ``api.proto``: the upstream service definition; ``api_pb2*.py`` are generated from it
  (``make protos``) and are not edited by hand.
- :mod:`~edge_agent.podresources.model`: what the rest of the agent sees, plain
  dataclasses (no gRPC types leave this package).
- :mod:`~edge_agent.podresources.client`: ``List`` with a deadline. It imports ``grpc``, so
  it is imported only once the socket exists: an agent outside Kubernetes never loads it.
- :mod:`~edge_agent.sim.pod_resources_server`: a real ``PodResourcesLister`` server, for the
  simulator (``--simulate-pod-resources``) and the tests.

Importing this package imports nothing of gRPC.
"""
