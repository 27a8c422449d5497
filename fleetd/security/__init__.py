"""Trust: ``certs`` (the fleet CA, node and client certificates), ``tls``
(every SSLContext), ``sessions`` (TLS session tickets across commands), ``procfs``
(files a traced process controls, read safely), ``private_dir`` and ``checks``
(``fleetd check --only certs``).
"""
