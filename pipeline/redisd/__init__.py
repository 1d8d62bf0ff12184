"""The Redis the run embeds (base floor): ``server.py``, the embedded redis-server
(loopback, per-run password, AOF); ``tls.py``, its TLS files and certificates, which
every client reads too."""
