"""What a node's frames do once its session is open: the session (``session``), the
delivery verdict for each BATCH (``delivery``), the ACKs it earns (``acks``) and the
sequence ranges they carry (``seqranges``)."""
