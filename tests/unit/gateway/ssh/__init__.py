"""The gateway stage ssh: its unit tests."""
