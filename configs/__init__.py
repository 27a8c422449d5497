"""Example deployment files (fleetd.yaml, the systemd unit, the Kubernetes DaemonSet),
shipped as package data ``fleetd.configs`` and found with ``fleetd.checks.example_file``."""
