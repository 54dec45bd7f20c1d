"""What ``--simulate`` runs instead of hardware: the NVML simulator and its machine
profiles, the simulated host (``/proc`` and cgroups), kubelet and pod-resources server.
Nothing here runs on a real edge box unless asked, and each says SIMULATED when it runs."""
