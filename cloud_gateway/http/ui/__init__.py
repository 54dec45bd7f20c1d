"""The operator page, ``/ui``: the fleet table, a node's page with its recent values, and
the HTML helpers. It is one of the HTTP port's faces (same state, same auth), so it
lives under ``http``."""
