"""Who may connect: the fleet PKI (certs), the certificate policy, the revocation list,
key policy, node-key signing (in process, or the signer process on a socket), login
limits and certificate expiry. The lowest stage: every other stage may ask it."""
