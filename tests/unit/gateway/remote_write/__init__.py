"""The gateway stage remote_write: its unit tests."""
