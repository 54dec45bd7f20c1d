"""Scrapes relayed to a node through its tunnel, by node name (``relay``), the upstream
HTTP exchange over a channel (``upstream``), the endpoint table of what each node
serves, and the hop to the peer gateway that holds a node (``peers``)."""
