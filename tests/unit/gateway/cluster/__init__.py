"""The gateway stage cluster: its unit tests."""
