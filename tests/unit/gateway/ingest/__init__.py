"""The gateway stage ingest: its unit tests."""
