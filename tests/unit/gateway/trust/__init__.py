"""The gateway stage trust: its unit tests."""
