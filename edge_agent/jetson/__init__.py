"""NVIDIA Jetson: what the kernel of an L4T board tells about its integrated GPU (issue 28).

DCGM does not support the Jetson iGPU and NVML answers little there, so this package reads
the kernel's own interfaces, each through a root parameter (as the cgroup readers take
``proc_root``), so that tests and ``--simulate`` point them at a fixture tree:

- :mod:`~edge_agent.jetson.board`: module model, SoC, L4T release and JetPack;
- :mod:`~edge_agent.jetson.gpu`: the GPU's devfreq node (load, frequency) and the EMC;
- :mod:`~edge_agent.jetson.thermal`: thermal zones by type;
- :mod:`~edge_agent.jetson.rails`: INA3221 / INA238 power rails (hwmon, and r32's iio);
- :mod:`~edge_agent.jetson.memory`: shared memory in use and nvmap's per-process memory.

Every reader returns what it could read and says why for what it could not (a
:class:`~edge_agent.jetson.files.Missing`), never raises for an absent or unreadable file:
a board without a rail or with debugfs closed still gives the rest. docs/jetson.md lists
each path, its unit and where its meaning was learnt.

- :mod:`~edge_agent.jetson.collector`: the device collector on them, behind the same seam
  as NVML's (:class:`edge_agent.collect.DeviceSource`);
- :mod:`~edge_agent.jetson.processes`: nvmap's clients as per-process GPU memory,
  attributed to containers and pods as on any node.

:func:`edge_agent.backend.open_backend` chooses this backend (``[gpu] backend``).
"""
