"""Several gateways on one node directory: the directory interface and its SQLite and
PostgreSQL stores, membership and claims, joining, limits, nonces, the ``[cluster]``
section, and ``link``, which ties this gateway's registry and endpoints to the directory."""
