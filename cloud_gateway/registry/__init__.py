"""What the gateway knows of each node: the pure store of nodes, families and series
(``store``), its records, reads and types, the series policy and family typing, the
``node`` label, liveness, and the text lines a series is kept as."""
