"""The SSH port: the asyncssh server (``server``), node logins and the certificate checks
at login (``logins``), name conflicts, the enrollment and renewal subsystems, and the
PROXY header a balancer puts before a connection (``balancer_header``,
``balancer_listener``)."""
