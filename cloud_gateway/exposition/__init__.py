"""The one node-keyed ``/metrics`` body, built from the registry: the body and its cache
(``body``), pieces and shards rendered in parallel, and the gzip members they are
joined from."""
