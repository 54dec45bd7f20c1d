"""The gateway stage exposition: its unit tests."""
