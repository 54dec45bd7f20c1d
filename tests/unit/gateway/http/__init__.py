"""The gateway stage http: its unit tests."""
