"""The gateway stage relay: its unit tests."""
