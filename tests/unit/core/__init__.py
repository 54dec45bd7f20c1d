"""The shared core's units (gpurelay)."""
