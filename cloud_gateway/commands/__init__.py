"""The operator's commands: ``certs`` (the fleet PKI), ``nodes`` and ``gateways`` (the
gateway's API, over HTTP)."""
