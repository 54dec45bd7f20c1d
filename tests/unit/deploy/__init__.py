"""What deploy/ ships, and the docs that describe it."""
