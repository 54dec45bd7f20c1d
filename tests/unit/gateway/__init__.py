"""The gateway's units: one folder per stage, as cloud_gateway/ is; here what wires them."""
