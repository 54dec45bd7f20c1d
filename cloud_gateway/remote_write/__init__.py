"""Prometheus remote write: the client and its ``[remote_write]`` section (``client``), the
per-node queue of batches waiting to be written (``forwarder``), and the protobuf
encoder (``prompb``)."""
