"""The gateway stage registry: its unit tests."""
