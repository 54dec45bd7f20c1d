"""The edge agent's units."""
